from mooncake._fast._verbs_cq import CQ
from mooncake._fast._verbs_lib import Resource
from mooncake._fast._verbs_mr import MR
from mooncake._fast._verbs_pd import PD

OP_WRITE: int
OP_READ: int
QPS_RESET: int
QPS_INIT: int
QPS_RTR: int
QPS_RTS: int
QPS_ERR: int
MTU_BYTES: dict[int, int]
MTU_ENUM: dict[int, int]

class QP(Resource):
    pd: PD
    send_cq: CQ
    recv_cq: CQ
    max_send_wr: int
    max_send_sge: int
    max_inline: int
    state: int
    qp_num: int
    def __init__(
        self,
        pd: PD,
        send_cq: CQ,
        recv_cq: CQ | None = None,
        *,
        max_send_wr: int = 256,
        max_send_sge: int = 4,
        max_inline: int = 64,
    ) -> None: ...
    def to_init(self, port: int = 1, pkey_index: int = 0, access: int = ...) -> None: ...
    def to_rtr(
        self,
        dest_qpn: int,
        dlid: int = 0,
        dgid: bytes | None = None,
        *,
        port: int = 1,
        sgid_index: int = 0,
        mtu: int = 4096,
        hop_limit: int = 16,
        traffic_class: int = 0,
        sl: int = 0,
        rq_psn: int = 0,
        max_dest_rd_atomic: int = 16,
        min_rnr_timer: int = 12,
    ) -> None: ...
    def to_rts(
        self,
        sq_psn: int = 0,
        timeout: int = 14,
        retry_cnt: int = 7,
        rnr_retry: int = 7,
        max_rd_atomic: int = 16,
    ) -> None: ...
    def to_error(self) -> None: ...
    def reset(self) -> None: ...
    @property
    def slots_free(self) -> int: ...
    def post(
        self,
        opcode: int,
        mrs: list[MR],
        local_addrs: list[int],
        lengths: list[int],
        remote_addrs: list[int],
        rkeys: list[int],
        cookies: list[int],
    ) -> int: ...
