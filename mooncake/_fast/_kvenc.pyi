from collections.abc import Callable

COMPILED: bool

def parse_seq_hash(key: str) -> int | None: ...
def encode_events(
    events: list[tuple[int, str, str]],
    first_event_id: int,
    ts_entry: bytes,
    heads: tuple[bytes, bytes],
    tails: tuple[bytes, bytes],
    mids: dict[tuple[int, str, str], bytes],
    middle_of: Callable[[int, str, str], bytes],
    prefix: str,
    split: Callable[[str], tuple[str, str]],
    okey: bytes | None,
    seq_key: bytes,
    block_key: bytes | None,
    empty: bytes,
) -> tuple[bytes, int, int]: ...
