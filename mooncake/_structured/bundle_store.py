"""The published module's ``_BundleManifestStore`` calls, on :class:`ManifestStore`.

``MooncakeBundleTransfer._bundle_store`` answers the calls of the published object by that
name that a caller can make without its transport internals:

* ``payload_keys(payload_spec)``: the chunk keys of one payload spec;
* ``put_bundle_manifest(meta, buffers, *, partition, chunk_bytes, policy, cleanup_keys=None,
  config=None)``: a new bundle whose ``meta`` is written now and whose ``buffers`` are payload
  specs already stored (a merged manifest); ``cleanup_keys`` are removed with it, and the
  object ids of its buffers and cleanup keys are listed in ``buffer_object_ids``;
* ``_put_direct_copy_payload`` / ``_put_multi_buffer_payload(key, value, chunk_bytes,
  transfer_policy, config=None)``: one multi-part payload written at ``key`` in chunks,
  answering ``(payload spec, keys written)``;
* ``remove_keys(keys, *, strict)`` and ``resolve_manifest(ref)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mooncake._structured.bundles import ManifestStore, encode_member
from mooncake._structured.io import remove_keys
from mooncake._structured.model import BundleTransferPolicy, RemoteBundleRef
from mooncake._structured.policy import check_policy, check_zero_copy
from mooncake.errors import InvalidArgumentError

__all__ = ["BundleManifestStore"]


class BundleManifestStore:
    """The published ``_BundleManifestStore`` calls over one :class:`ManifestStore`."""

    def __init__(self, bundles: ManifestStore) -> None:
        self._bundles = bundles

    @staticmethod
    def payload_keys(payload_spec: Mapping[str, Any]) -> list[str]:
        """The chunk keys of ``payload_spec`` in order."""
        return [str(c["key"]) for c in payload_spec["chunks"]]

    def put_bundle_manifest(
        self,
        meta: bytes | bytearray | memoryview,
        buffers: Mapping[str, Any],
        *,
        partition: str,
        chunk_bytes: int | None,
        policy: BundleTransferPolicy | None,
        cleanup_keys: Sequence[str] | None = None,
        config: Any = None,
    ) -> RemoteBundleRef:
        """Write ``meta`` and a manifest over the stored payload specs ``buffers`` (each must
        lie in this key prefix; ``InvalidArgumentError`` otherwise, before the manifest is
        written); on failure what this call wrote is removed."""
        check_policy(policy)
        for name, spec in buffers.items():
            if not isinstance(spec, Mapping):
                raise InvalidArgumentError(f"bundle buffer {name!r} must be a payload spec")
        return self._bundles.put_bundle(
            meta,
            {},
            partition=partition,
            chunk_bytes=chunk_bytes,
            config=config,
            reuse_buffers={n: dict(s) for n, s in buffers.items()},
            cleanup_keys=list(cleanup_keys or []),
            policy=policy,
        )

    def _put_parts_payload(
        self,
        key: str,
        value: Any,
        chunk_bytes: int,
        transfer_policy: BundleTransferPolicy | None,
        config: Any = None,
    ) -> tuple[dict[str, Any], list[str]]:
        policy = check_policy(transfer_policy)
        check_zero_copy(policy, {key: value})
        _spec, src = encode_member(key, value)
        return self._bundles.put_payload(key, src, chunk_bytes, config, policy)

    _put_direct_copy_payload = _put_parts_payload
    _put_multi_buffer_payload = _put_parts_payload

    def remove_keys(self, keys: Sequence[str], *, strict: bool) -> None:
        """Remove ``keys`` (``strict``: a failed removal raises)."""
        remove_keys(self._bundles.store, keys, strict=strict)

    def resolve_manifest(self, ref: RemoteBundleRef | Mapping[str, Any]) -> dict[str, Any]:
        """The validated manifest of ``ref``."""
        return self._bundles.resolve(ref)
