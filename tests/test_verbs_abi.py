"""The vendored ABI header against rdma-core's <infiniband/verbs.h>, and loading without it.

Where the real header is installed (Debian: libibverbs-dev) a C file including both is compiled
with a static assertion per struct size, field offset and enum value we rely on; elsewhere the
check skips. ``MC_RDMA_CORE_INCLUDE`` (``:``-separated directories holding
``infiniband/verbs.h``) adds other rdma-core versions, e.g. the headers pyverbs is built from
(``scripts/rdma-core-headers.sh`` makes that directory from the pyverbs sdist). The loader tests run in subprocesses: a process opens one verbs library for good.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "mooncake" / "_fast" / "csrc"
REAL = Path("/usr/include/infiniband/verbs.h")
INCLUDES = [str(REAL.parents[1])] if REAL.exists() else []
INCLUDES += [d for d in os.environ.get("MC_RDMA_CORE_INCLUDE", "").split(":") if d]
# structs rdma-core extends at the end while its exported entry points keep writing the old
# layout (ibv_query_port@IBVERBS_1.1 takes struct _compat_ibv_port_attr): ours may be shorter
GROWN = {"port_attr"}

# struct -> fields we declare (every one is checked)
FIELDS = {
    "device": ["_ops", "node_type", "transport_type", "name", "dev_name", "dev_path", "ibdev_path"],
    "context": ["device", "ops", "cmd_fd", "async_fd", "num_comp_vectors", "mutex", "abi_compat"],
    "context_ops": [
        "poll_cq",
        "req_notify_cq",
        "post_srq_recv",
        "post_send",
        "post_recv",
        "_compat_async_event",
    ],
    "device_attr": [
        "fw_ver",
        "node_guid",
        "max_mr_size",
        "vendor_id",
        "max_qp",
        "max_qp_wr",
        "max_sge",
        "max_cq",
        "max_cqe",
        "max_mr",
        "max_qp_rd_atom",
        "max_qp_init_rd_atom",
        "atomic_cap",
        "max_srq_sge",
        "max_pkeys",
        "phys_port_cnt",
    ],
    "port_attr": [
        "state",
        "max_mtu",
        "active_mtu",
        "gid_tbl_len",
        "port_cap_flags",
        "max_msg_sz",
        "pkey_tbl_len",
        "lid",
        "sm_lid",
        "lmc",
        "active_width",
        "active_speed",
        "phys_state",
        "link_layer",
        "flags",
        "port_cap_flags2",
    ],
    "pd": ["context", "handle"],
    "mr": ["context", "pd", "addr", "length", "handle", "lkey", "rkey"],
    "comp_channel": ["context", "fd", "refcnt"],
    "cq": [
        "context",
        "channel",
        "cq_context",
        "handle",
        "cqe",
        "mutex",
        "cond",
        "comp_events_completed",
        "async_events_completed",
    ],
    "qp": [
        "context",
        "qp_context",
        "pd",
        "send_cq",
        "recv_cq",
        "srq",
        "handle",
        "qp_num",
        "state",
        "qp_type",
        "mutex",
        "cond",
        "events_completed",
    ],
    "qp_cap": ["max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge", "max_inline_data"],
    "qp_init_attr": ["qp_context", "send_cq", "recv_cq", "srq", "cap", "qp_type", "sq_sig_all"],
    "global_route": ["dgid", "flow_label", "sgid_index", "hop_limit", "traffic_class"],
    "ah_attr": ["grh", "dlid", "sl", "src_path_bits", "static_rate", "is_global", "port_num"],
    "qp_attr": [
        "qp_state",
        "cur_qp_state",
        "path_mtu",
        "path_mig_state",
        "qkey",
        "rq_psn",
        "sq_psn",
        "dest_qp_num",
        "qp_access_flags",
        "cap",
        "ah_attr",
        "alt_ah_attr",
        "pkey_index",
        "alt_pkey_index",
        "en_sqd_async_notify",
        "sq_draining",
        "max_rd_atomic",
        "max_dest_rd_atomic",
        "min_rnr_timer",
        "port_num",
        "timeout",
        "retry_cnt",
        "rnr_retry",
        "alt_port_num",
        "alt_timeout",
        "rate_limit",
    ],
    "sge": ["addr", "length", "lkey"],
    "send_wr": [
        "wr_id",
        "next",
        "sg_list",
        "num_sge",
        "opcode",
        "send_flags",
        "imm_data",
        "wr.rdma.remote_addr",
        "wr.rdma.rkey",
        "wr.atomic.rkey",
        "qp_type.xrc.remote_srqn",
        "bind_mw.bind_info.mw_access_flags",
        "tso.mss",
    ],
    "recv_wr": ["wr_id", "next", "sg_list", "num_sge"],
    "wc": [
        "wr_id",
        "status",
        "opcode",
        "vendor_err",
        "byte_len",
        "imm_data",
        "qp_num",
        "src_qp",
        "wc_flags",
        "pkey_index",
        "slid",
        "sl",
        "dlid_path_bits",
    ],
}
REAL_NAME = {"device_attr": "ibv_device_attr", "port_attr": "ibv_port_attr"}
ENUMS = [
    "QPT_RC",
    "QPS_RESET",
    "QPS_INIT",
    "QPS_RTR",
    "QPS_RTS",
    "QPS_SQD",
    "QPS_SQE",
    "QPS_ERR",
    "QP_STATE",
    "QP_CUR_STATE",
    "QP_ACCESS_FLAGS",
    "QP_PKEY_INDEX",
    "QP_PORT",
    "QP_AV",
    "QP_PATH_MTU",
    "QP_TIMEOUT",
    "QP_RETRY_CNT",
    "QP_RNR_RETRY",
    "QP_RQ_PSN",
    "QP_MAX_QP_RD_ATOMIC",
    "QP_MIN_RNR_TIMER",
    "QP_SQ_PSN",
    "QP_MAX_DEST_RD_ATOMIC",
    "QP_DEST_QPN",
    "ACCESS_LOCAL_WRITE",
    "ACCESS_REMOTE_WRITE",
    "ACCESS_REMOTE_READ",
    "ACCESS_REMOTE_ATOMIC",
    "ACCESS_RELAXED_ORDERING",
    "WR_RDMA_WRITE",
    "WR_RDMA_WRITE_WITH_IMM",
    "WR_SEND",
    "WR_RDMA_READ",
    "SEND_FENCE",
    "SEND_SIGNALED",
    "SEND_SOLICITED",
    "SEND_INLINE",
    "WC_RDMA_WRITE",
    "WC_RDMA_READ",
    "WC_SUCCESS",
    "WC_LOC_LEN_ERR",
    "WC_LOC_QP_OP_ERR",
    "WC_LOC_PROT_ERR",
    "WC_WR_FLUSH_ERR",
    "WC_LOC_ACCESS_ERR",
    "WC_REM_INV_REQ_ERR",
    "WC_REM_ACCESS_ERR",
    "WC_REM_OP_ERR",
    "WC_RETRY_EXC_ERR",
    "WC_RNR_RETRY_EXC_ERR",
    "WC_FATAL_ERR",
    "WC_GENERAL_ERR",
    "PORT_DOWN",
    "PORT_ACTIVE",
    "LINK_LAYER_INFINIBAND",
    "LINK_LAYER_ETHERNET",
    "MTU_256",
    "MTU_1024",
    "MTU_4096",
]


def _check_source() -> str:
    lines = [
        "#include <stddef.h>",
        "#include <infiniband/verbs.h>",
        '#include "mc_verbs_abi.h"',
        '#define SAME(a, b) _Static_assert((long long)(a) == (long long)(b), #a " != " #b)',
    ]
    for short, fields in FIELDS.items():
        ours = f"struct mcv_{short}"
        real = f"struct {REAL_NAME.get(short, 'ibv_' + short)}"
        if short == "device":
            lines.append(f"SAME(sizeof({ours}), sizeof({real}));")
        elif short in GROWN:
            lines.append(
                f'_Static_assert(sizeof({ours}) <= sizeof({real}), "{ours} outgrew {real}");'
            )
            lines.append(f"SAME(_Alignof({ours}), _Alignof({real}));")
        else:
            lines.append(f"SAME(sizeof({ours}), sizeof({real}));")
            lines.append(f"SAME(_Alignof({ours}), _Alignof({real}));")
        for f in fields:
            lines.append(f"SAME(offsetof({ours}, {f}), offsetof({real}, {f}));")
    lines.append("SAME(sizeof(union mcv_gid), sizeof(union ibv_gid));")
    lines += [f"SAME(MCV_{e}, IBV_{e});" for e in ENUMS]
    return "\n".join(lines) + "\nint main(void) { return 0; }\n"


@pytest.mark.skipif(not INCLUDES, reason="rdma-core headers not installed (libibverbs-dev)")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not found")
@pytest.mark.parametrize("include", INCLUDES or ["-"])
def test_vendored_abi_matches_rdma_core_headers(tmp_path: Path, include: str) -> None:
    assert (Path(include) / "infiniband" / "verbs.h").exists(), include
    src = tmp_path / "abi_check.c"
    src.write_text(_check_source())
    res = subprocess.run(
        [
            "gcc",
            "-std=c11",
            "-Wall",
            "-Werror",
            f"-I{include}",
            f"-I{CSRC}",
            "-c",
            str(src),
            "-o",
            str(tmp_path / "abi_check.o"),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    # the check itself can fail: one deliberate mismatch must be caught
    bad = _check_source().replace(
        "SAME(offsetof(struct mcv_wc, qp_num)", "SAME(1 + offsetof(struct mcv_wc, qp_num)"
    )
    src.write_text(bad)
    res = subprocess.run(
        [
            "gcc",
            "-std=c11",
            f"-I{include}",
            f"-I{CSRC}",
            "-c",
            str(src),
            "-o",
            str(tmp_path / "bad.o"),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "qp_num" in res.stderr


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full,
        timeout=60,
    )


def test_importing_the_layer_does_not_open_libibverbs() -> None:
    res = _run("""
        import mooncake._fast.verbs as v
        maps = open('/proc/self/maps').read()
        print(v.AVAILABLE, 'libibverbs' in maps, 'mcsoftverbs' in maps,
              v.loaded_path() if v.AVAILABLE else None)
    """)
    assert res.returncode == 0, res.stderr
    available = res.stdout.split()[0] == "True"
    if not available:
        pytest.skip("verbs extensions not built")
    assert res.stdout.split()[1:] == ["False", "False", "None"]


def test_missing_library_is_a_clear_error() -> None:
    res = _run(
        """
        import mooncake._fast.verbs as v
        from mooncake.errors import VerbsUnavailableError
        if not v.AVAILABLE:
            raise SystemExit(3)
        try:
            v.get_device_list()
        except VerbsUnavailableError as e:
            print('ERR', e)
    """,
        MOONCAKE_IBVERBS="/nonexistent/libibverbs.so.1",
    )
    if res.returncode == 3:
        pytest.skip("verbs extensions not built")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ERR cannot load verbs library '/nonexistent/libibverbs.so.1'")
    assert "MOONCAKE_IBVERBS=soft" in res.stdout


def test_real_libibverbs_without_kernel_support_reports_why() -> None:
    """On a host with libibverbs but no RDMA kernel support the list fails with ENOSYS."""
    res = _run(
        """
        import mooncake._fast.verbs as v
        from mooncake.errors import VerbsUnavailableError
        if not v.AVAILABLE:
            raise SystemExit(3)
        try:
            v.load()
        except VerbsUnavailableError:
            raise SystemExit(4)
        try:
            print('DEVICES', v.get_device_list())
        except VerbsUnavailableError as e:
            print('ERR', e)
    """,
        MOONCAKE_IBVERBS="",
    )
    if res.returncode == 3:
        pytest.skip("verbs extensions not built")
    if res.returncode == 4:
        pytest.skip("libibverbs.so.1 not installed")
    assert res.returncode == 0, res.stderr
    if res.stdout.startswith("DEVICES"):
        pytest.skip(f"this host has RDMA support: {res.stdout.strip()}")
    # the library's own errno (ENOSYS without kernel support), not a made-up one
    assert res.stdout.startswith("ERR ibv_get_device_list failed: [errno 38]"), res.stdout


def test_engine_with_rdma_on_a_host_without_rdma_fails_clearly() -> None:
    res = _run(
        """
        import anyio, mooncake
        from mooncake._fast import verbs
        from mooncake._engine.transports import default_transports
        from mooncake.errors import VerbsUnavailableError
        if not verbs.AVAILABLE:
            raise SystemExit(3)
        print('DEFAULT', default_transports())
        async def main():
            async with mooncake.open_engine(transports=['rdma']):
                pass
        try:
            anyio.run(main, backend='trio')
        except VerbsUnavailableError as e:
            print('ERR', e)
        except BaseExceptionGroup as eg:
            (e,) = eg.exceptions
            print('ERR', type(e).__name__, e)
        """,
        MOONCAKE_IBVERBS="",
    )
    if res.returncode == 3:
        pytest.skip("verbs extensions not built")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    if Path("/sys/class/infiniband").exists():
        pytest.skip("this host has RDMA devices")
    assert lines[0].startswith("DEFAULT [") and "'tcp'" in lines[0] and "'rdma'" not in lines[0]
    assert lines[1].startswith("ERR"), lines
    assert "ibv_get_device_list failed: [errno 38]" in lines[1] or "cannot load" in lines[1]
