"""The structured object store: DataProto-like bundles over ``MooncakeDistributedStore``.

The public names live in :mod:`mooncake.structured_object_store`; this package holds the parts:
:mod:`.model` (the public records and transport handles), :mod:`.codecs` (non-tensor column
codecs), :mod:`.bundles` (manifests, payload keys and the batched store I/O) and
:mod:`.dataproto` (stages, field selection and row reads).
"""
