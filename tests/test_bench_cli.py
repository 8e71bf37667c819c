"""``mooncake bench transfer``: a real two-process run, its JSON, its table, its argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake._cli import main


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bench_transfer_json(
    tmp_path: Path, transport: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "transfer",
            "--sizes",
            "4K,64K",
            "--batches",
            "1,4",
            "--ops",
            "write,read",
            "--case-seconds",
            "0.05",
            "--buffer",
            "16M",
            "--transport",
            transport,
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["verify_read"] is True and res["verify_write"] is True
    assert res["used_transport"] == transport
    cases = res["cases"]
    assert [(c["op"], c["block"], c["batch"]) for c in cases] == [
        (op, bs, b) for op in ("write", "read") for bs in (4096, 65536) for b in (1, 4)
    ]
    for c in cases:
        assert c["errors"] == 0 and c["calls"] >= 3
        assert c["bytes"] == c["calls"] * c["block"] * c["batch"]
        assert c["GBps"] > 0 and c["call_us_p50"] <= c["call_us_p99"]
    table = capsys.readouterr().out
    assert "GB/s" in table and "64KiB" in table


def test_bench_transfer_skips_what_does_not_fit(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "transfer",
            "--sizes",
            "16M",
            "--batches",
            "1",
            "--ops",
            "read",
            "--case-seconds",
            "0.05",
            "--buffer",
            "16M",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    res = json.loads(out.read_text())
    assert rc == 0 and res["cases"][0]["calls"] >= 3  # 16M x 1 fits a 16M buffer
    out2 = tmp_path / "r2.json"
    rc = main(
        [
            "bench",
            "transfer",
            "--sizes",
            "8M",
            "--batches",
            "4",
            "--ops",
            "read",
            "--case-seconds",
            "0.05",
            "--buffer",
            "8M",
            "--no-progress",
            "--json",
            str(out2),
        ]
    )
    res = json.loads(out2.read_text())
    assert rc == 0 and res["cases"][0]["skipped"] == "does not fit buffer"
    assert res["verify_write"] is None  # too small for the write check: said, not faked


@pytest.mark.parametrize(
    "argv",
    [
        ["--sizes", "4Q"],
        ["--ops", "copy"],
        ["--batches", "0"],
        ["--transport", "rdma"],
    ],
)
def test_bench_transfer_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "transfer", *argv]) == 2
    assert "mooncake bench transfer:" in capsys.readouterr().err


def test_bench_without_a_benchmark_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 2
    assert "transfer" in capsys.readouterr().out
