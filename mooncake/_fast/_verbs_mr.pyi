from typing import Any

from mooncake._fast._verbs_lib import Resource
from mooncake._fast._verbs_pd import PD

ACCESS_LOCAL_WRITE: int
ACCESS_REMOTE_WRITE: int
ACCESS_REMOTE_READ: int
ACCESS_DEFAULT: int

class MR(Resource):
    pd: PD
    addr: int
    length: int
    lkey: int
    rkey: int
    access: int
    def __init__(
        self,
        pd: PD,
        obj: Any = None,
        access: int = ...,
        *,
        addr: int | None = None,
        length: int | None = None,
        owner: Any = None,
    ) -> None: ...
    @staticmethod
    def from_address(
        pd: PD, addr: int, length: int, access: int = ..., owner: Any = None
    ) -> MR: ...
    def covers(self, addr: int, length: int) -> bool: ...
