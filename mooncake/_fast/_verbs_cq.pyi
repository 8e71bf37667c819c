from array import array

from mooncake._fast._verbs_device import Context
from mooncake._fast._verbs_lib import Resource

WC_STATUS_NAMES: dict[int, str]

class CompChannel(Resource):
    context: Context
    def __init__(self, context: Context) -> None: ...
    @property
    def fd(self) -> int: ...
    def get_events(self) -> int: ...

class WcBatch:
    capacity: int
    cookies: array[int]
    status: array[int]
    opcode: array[int]
    byte_len: array[int]
    qp_num: array[int]
    vendor_err: array[int]
    def __init__(self, capacity: int = 64) -> None: ...

class CQ(Resource):
    context: Context
    channel: CompChannel | None
    cqe: int
    stray: int
    def __init__(
        self, context: Context, cqe: int = 4096, channel: CompChannel | None = None
    ) -> None: ...
    @property
    def slots_free(self) -> int: ...
    def req_notify(self, solicited_only: bool = False) -> None: ...
    def poll(self, out: WcBatch) -> int: ...
