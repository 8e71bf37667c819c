"""One key rule: the client and the master refuse the same keys with the same errors."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake._core.master import MAX_KEY_LENGTH as MASTER_MAX
from mooncake._core.master import MasterConfig, MasterState
from mooncake._core.store_types import MAX_KEY_LENGTH, ReplicateConfig, check_key
from mooncake.errors import InvalidArgumentError

BAD: list[tuple[Any, str]] = [
    (b"k", "key must be a str, got bytes .decode it first"),
    (7, "key must be a str, got int"),
    ("", "key must not be empty"),
    ("x" * (MAX_KEY_LENGTH + 1), f"characters is too long .at most {MAX_KEY_LENGTH}"),
    ("a\ud800b", "not valid UTF-8 .lone surrogate at index 1"),
]


@pytest.mark.parametrize(("key", "why"), BAD, ids=["bytes", "int", "empty", "long", "surrogate"])
def test_client_and_master_refuse_alike(key: Any, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        check_key(key)
    m = MasterState(MasterConfig(seed=0))
    with pytest.raises(InvalidArgumentError, match=why):
        m.put_start("client", key, 16, ReplicateConfig(), 0.0)


def test_good_keys_pass_unchanged() -> None:
    for key in ("k", "é/ü", "x" * MAX_KEY_LENGTH):
        assert check_key(key) is key


def test_every_user_of_the_rule_is_the_one_function() -> None:
    from mooncake._core.master import config
    from mooncake._store import moves

    assert moves._check_key is check_key
    assert config._check_key is check_key
    assert MASTER_MAX == MAX_KEY_LENGTH
