"""The published ``mooncake_master`` binary's own flags: type, default and meaning.

As its ``--helpfull`` lists them (mooncake-store/src/master.cpp and utils.cpp), so
``mooncake_master --help`` can say what each flag means, and a flag outside this table and
:data:`FRAMEWORK_FLAGS` (gflags' and glog's own) is a typo, refused as gflags refuses it.
"""

from __future__ import annotations

#: name -> (type, default, meaning), as the published binary documents them
PUBLISHED_FLAGS: dict[str, tuple[str, str, str]] = {
    "allocation_strategy": (
        "string",
        '"random"',
        "Allocation strategy for segments, random | free_ratio_first | cxl | ssd_free_ratio_first | local_first",
    ),
    "allow_evict_soft_pinned_objects": (
        "bool",
        "true",
        "Whether to allow eviction of soft pinned objects during eviction",
    ),
    "batch_oplog_retry_timeout_sec": (
        "uint32",
        "180",
        "Maximum time to retry transient batch OpLog standby errors.",
    ),
    "client_ttl": (
        "int64",
        "10",
        "Seconds a client stays considered alive after the last heartbeat. If this TTL elapses without a refresh, the master treats the client as disconnected and may unmount its segments",
    ),
    "cluster_id": (
        "string",
        '"mooncake_cluster"',
        "Cluster ID for the master service, used for kvcache persistence in HA mode",
    ),
    "config_path": ("string", '""', "master service config file path"),
    "cxl_path": ("string", '"/dev/dax0.0"', "DAX device path for CXL memory"),
    "cxl_size": ("uint64", "8589934592", "CXL memory size in bytes"),
    "default_kv_lease_ttl": (
        "string",
        '"10000"',
        "Default lease time for kv objects. Supports raw milliseconds or duration strings with ms, s, m, or h suffixes",
    ),
    "default_kv_soft_pin_ttl": (
        "string",
        '"1800000"',
        "Default soft pin TTL for kv objects. Supports raw milliseconds or duration strings with ms, s, m, or h suffixes",
    ),
    "dynamic_replication_admission_qps_threshold": (
        "double",
        "0.80000000000000004",
        "Per-key access frequency threshold for dynamic MEMORY replication",
    ),
    "dynamic_replication_heat_window_seconds": (
        "uint32",
        "10",
        "Heat observation window for dynamic MEMORY replication",
    ),
    "dynamic_replication_max_memory_replicas": (
        "uint64",
        "2",
        "Maximum MEMORY replicas allowed for one dynamically replicated key",
    ),
    "dynamic_replication_mode": (
        "string",
        '"off"',
        "Dynamic MEMORY replica fanout mode: off, observe, or enforce",
    ),
    "enable_cxl": ("bool", "false", "Whether to enable CXL memory support"),
    "enable_disk_eviction": (
        "bool",
        "true",
        "Enable disk eviction feature for storage backend (default: true)",
    ),
    "enable_ha": ("bool", "false", "Enable high availability using the configured HA backend"),
    "enable_http_metadata_server": ("bool", "false", "Enable HTTP metadata server instead of etcd"),
    "enable_kv_events": ("bool", "false", "Enable RFC #1527 KV cache event publisher over ZMQ"),
    "enable_metadata_cleanup_on_timeout": (
        "bool",
        "false",
        "Enable cleanup of HTTP metadata (mooncake/ram/*, mooncake/rpc_meta/*) when client heartbeat times out. Works in two modes: (1) co-located (enable_http_metadata_server=true) via in-process removal, or (2) separately-deployed metadata server via async HTTP DELETE.",
    ),
    "enable_metric_reporting": ("bool", "true", "Enable periodic metric reporting"),
    "enable_multi_tenants": (
        "bool",
        "false",
        "Enable strict multi-tenant namespace and quota admission",
    ),
    "enable_offload": ("bool", "false", "Enable offload availability"),
    "enable_oplog": ("bool", "false", "Enable HA metadata replication through batch-record OpLog"),
    "enable_snapshot": ("bool", "false", "Enable periodic snapshot of master data"),
    "enable_snapshot_restore": ("bool", "false", "enable restore from snapshot"),
    "etcd_endpoints": (
        "string",
        '""',
        "Endpoints of ETCD server, separated by semicolon, required in HA mode",
    ),
    "eviction_high_watermark_ratio": (
        "double",
        "0.90000000000000002",
        "Ratio of high watermark trigger eviction in Memory",
    ),
    "eviction_ratio": (
        "double",
        "0.050000000000000003",
        "Ratio of objects to evict when Memory space is full",
    ),
    "global_file_segment_size": (
        "int64",
        "9223372036854775807",
        "Size of global NFS/3FS segment in bytes",
    ),
    "ha_backend_connstring": (
        "string",
        '""',
        "HA backend connection string. If unset, only backend_type=etcd falls back to etcd_endpoints for backward compatibility",
    ),
    "ha_backend_type": ("string", '"etcd"', "HA backend type, e.g. etcd | redis | k8s"),
    "http_metadata_server_host": (
        "string",
        '"0.0.0.0"',
        "Host for HTTP metadata server to bind to",
    ),
    "http_metadata_server_port": ("int32", "8080", "Port for HTTP metadata server to listen on"),
    "kv_events_additional_salt": (
        "string",
        '""',
        "Deprecated: not emitted on events; use indexer POST /register",
    ),
    "kv_events_backend_id": (
        "string",
        '""',
        "backend_id for published KV events (cache owner identity)",
    ),
    "kv_events_bind_endpoint": (
        "string",
        '""',
        "ZMQ PUB bind endpoint for KV events, e.g. tcp://0.0.0.0:5557",
    ),
    "kv_events_block_size": (
        "uint32",
        "0",
        "Deprecated: not emitted on events; use indexer POST /register",
    ),
    "kv_events_dp_rank": (
        "uint32",
        "0",
        "Deprecated: not emitted on events; use indexer POST /register",
    ),
    "kv_events_emit_legacy_compat": (
        "bool",
        "true",
        "Include vLLM/SGLang-compatible type/block_hashes fields",
    ),
    "kv_events_emit_object_key": (
        "bool",
        "true",
        "Include Mooncake object_key in published KV events",
    ),
    "kv_events_lora_name": (
        "string",
        '""',
        "Deprecated: not emitted on events (no LoRA context in master)",
    ),
    "kv_events_model_name": (
        "string",
        '""',
        "Deprecated: not emitted on events; use indexer POST /register",
    ),
    "kv_events_queue_capacity": (
        "uint32",
        "65536",
        "Maximum pending KV events; oldest events are dropped when the queue is full (0 = unbounded)",
    ),
    "kv_events_tenant_id": (
        "string",
        '"default"',
        "Deprecated: tenant_id comes from each object on events",
    ),
    "max_kv_soft_pin_ttl": (
        "string",
        '"86400000"',
        "Maximum request-level soft pin TTL for kv objects. Supports raw milliseconds or duration strings with ms, s, m, or h suffixes",
    ),
    "max_retry_attempts": ("uint32", "10", "Maximum number of retry attempts for failed tasks"),
    "max_threads": (
        "int32",
        "16",
        "Maximum number of threads to use (deprecated, use rpc_thread_num)",
    ),
    "max_total_finished_tasks": (
        "uint32",
        "10000",
        "Maximum number of finished tasks to keep in memory",
    ),
    "max_total_pending_tasks": (
        "uint32",
        "10000",
        "Maximum number of pending tasks to keep in memory",
    ),
    "max_total_processing_tasks": (
        "uint32",
        "10000",
        "Maximum number of processing tasks to keep in memory",
    ),
    "memory_allocator": (
        "string",
        '"offset"',
        "Memory allocator for global segments, cachelib | offset",
    ),
    "metrics_host": (
        "string",
        '"0.0.0.0"',
        'Address for the HTTP metrics/admin server to listen on. Use "::" to listen on IPv6 (and IPv4 on dual-stack hosts)',
    ),
    "metrics_port": ("int32", "9003", "Port for HTTP metrics server to listen on"),
    "mmap_arena_pool_size": ("uint64", "8589934592", "Arena allocator pool size in bytes"),
    "nof_eviction_high_watermark_ratio": (
        "double",
        "0.90000000000000002",
        "Ratio of high watermark trigger eviction in NoF SSD",
    ),
    "nof_eviction_ratio": (
        "double",
        "0.050000000000000003",
        "Ratio of objects to evict when NoF SSD space is full",
    ),
    "nof_heartbeat_failures_threshold": (
        "uint32",
        "3",
        "Consecutive NoF heartbeat failures required before unmounting a NoF segment",
    ),
    "nof_heartbeat_interval_sec": (
        "int64",
        "10",
        "How often master probes each mounted NoF segment",
    ),
    "nof_heartbeat_probe_timeout_ms": (
        "uint32",
        "1000",
        "Timeout in milliseconds for a single NoF heartbeat probe",
    ),
    "offload_cap_ratio": (
        "double",
        "0.5",
        "Per-cycle offload cap as a fraction of offloading_queue_limit. Controls how many objects can be queued for offload in a single eviction cycle before falling back to force-evict",
    ),
    "offload_force_evict": (
        "bool",
        "false",
        "Force-evict objects exceeding offload cap without disk offload",
    ),
    "offload_on_evict": (
        "bool",
        "false",
        "Defer LOCAL_DISK offload to eviction time instead of PutEnd",
    ),
    "offloading_queue_limit": (
        "uint64",
        "50000",
        "Maximum number of objects allowed in the offloading queue per local disk segment. Increase to allow more objects to be offloaded to SSD before force-eviction kicks in",
    ),
    "oplog_batch_max_entries": (
        "uint32",
        "1024",
        "Maximum number of committed/reserved entries in the open batch-record OpLog waiting batch.",
    ),
    "oplog_poll_interval_ms": ("int32", "1000", "Batch-record standby poll interval."),
    "pending_task_timeout_sec": (
        "uint64",
        "300",
        "Timeout in seconds for pending tasks (0 = no timeout)",
    ),
    "pod_name": ("string", '""', "Pod name for K8s label-based routing (default: $POD_NAME)"),
    "pod_namespace": (
        "string",
        '""',
        "Pod namespace for K8s label-based routing (default: $POD_NAMESPACE)",
    ),
    "port": ("int32", "50051", "Port for master service to listen on (deprecated, use rpc_port)"),
    "processing_task_timeout_sec": (
        "uint64",
        "300",
        "Timeout in seconds for processing tasks (0 = no timeout)",
    ),
    "promotion_admission_threshold": (
        "uint32",
        "2",
        "Min CountMinSketch count for a key before promotion fires (set 1 to disable second-touch gating)",
    ),
    "promotion_max_per_heartbeat": (
        "uint32",
        "1",
        "Max promotion tasks returned to a single client per PromotionObjectHeartbeat call. Each task is a synchronous SSD-read + RDMA-write on the client; serializing them avoids blocking past the client-liveness window. Default 1 is conservative.",
    ),
    "promotion_on_hit": (
        "bool",
        "false",
        "Promote LOCAL_DISK-only keys to MEMORY on read access (mirror of offload_on_evict)",
    ),
    "promotion_queue_limit": ("uint32", "50000", "Max in-flight promotion tasks across all shards"),
    "put_start_discard_timeout_sec": (
        "uint64",
        "30",
        "Timeout for discarding uncompleted PutStart operations",
    ),
    "put_start_release_timeout_sec": (
        "uint64",
        "600",
        "Timeout for releasing space allocated in uncompleted PutStart operations",
    ),
    "quota_bytes": (
        "uint64",
        "0",
        "Quota for storage backend in bytes (0 = use default 90% of capacity)",
    ),
    "root_fs_dir": ("string", '""', "Root directory for storage backend, used in HA mode"),
    "rpc_address": (
        "string",
        '"0.0.0.0"',
        "Address for RPC server to bind to, required in HA mode",
    ),
    "rpc_conn_timeout_seconds": ("int32", "0", "Connection timeout in seconds (0 = no timeout)"),
    "rpc_enable_tcp_no_delay": ("bool", "true", "Enable TCP_NODELAY for RPC connections"),
    "rpc_interface": (
        "string",
        '""',
        "Network interface name for RPC server address resolution. When set, its IPv4 address overrides rpc_address",
    ),
    "rpc_port": (
        "int32",
        "0",
        "Port for RPC server to listen on (0 = use port, preferred over port)",
    ),
    "rpc_thread_num": (
        "int32",
        "0",
        "Number of threads for RPC server (0 = use max_threads, preferred over max_threads)",
    ),
    "snapshot_backup_dir": (
        "string",
        '""',
        "Optional local directory for snapshot and restore backup. If empty, local backup is disabled",
    ),
    "snapshot_catalog_backend_connstring": (
        "string",
        '""',
        "Deprecated alias of --snapshot_catalog_store_connstring",
    ),
    "snapshot_catalog_backend_type": (
        "string",
        '""',
        "Deprecated alias of --snapshot_catalog_store_type",
    ),
    "snapshot_catalog_store_connstring": (
        "string",
        '""',
        "Optional connection string for snapshot catalog store",
    ),
    "snapshot_catalog_store_type": (
        "string",
        '""',
        "Snapshot catalog store type: ''/'embedded' or 'redis' ('payload' is kept as a deprecated alias)",
    ),
    "snapshot_child_timeout_seconds": (
        "uint64",
        "300",
        "Timeout for snapshot child process in seconds",
    ),
    "snapshot_interval_seconds": (
        "uint64",
        "600",
        "Interval in second between periodic snapshots of master data",
    ),
    "snapshot_object_store_type": (
        "string",
        '""',
        "Snapshot object store type: 'local' for local filesystem, 's3' for S3 storage",
    ),
    "snapshot_payload_backend_type": (
        "string",
        '""',
        "Deprecated alias of --snapshot_object_store_type",
    ),
    "snapshot_payload_store_type": (
        "string",
        '""',
        "Deprecated alias of --snapshot_object_store_type",
    ),
    "snapshot_retention_count": (
        "uint32",
        "2",
        "Number of recent snapshots to keep (older snapshots will be automatically deleted)",
    ),
    "tenant_quota_connector_type": ("string", '"file"', "Tenant quota policy connector type"),
    "tenant_quota_connector_uri": ("string", '""', "Tenant quota policy connector URI"),
    "use_mmap_arena_allocator": (
        "bool",
        "false",
        "Enable the lock-free mmap arena allocator for mmap buffers",
    ),
}

#: gflags' and glog's flags, which every gflags binary accepts
FRAMEWORK_FLAGS: frozenset[str] = frozenset(
    {
        "alsologtoemail",
        "alsologtostderr",
        "colorlogtostderr",
        "drop_log_memory",
        "flagfile",
        "fromenv",
        "help",
        "helpfull",
        "helpmatch",
        "helpon",
        "helppackage",
        "helpshort",
        "helpxml",
        "log_backtrace_at",
        "log_dir",
        "log_link",
        "log_prefix",
        "logbuflevel",
        "logbufsecs",
        "logemaillevel",
        "logfile_mode",
        "logmailer",
        "logtostderr",
        "max_log_size",
        "minloglevel",
        "stderrthreshold",
        "stop_logging_if_full_disk",
        "symbolize_stacktrace",
        "tab_completion_columns",
        "tab_completion_word",
        "tryfromenv",
        "undefok",
        "v",
        "version",
        "vmodule",
    }
)
