/*
 * The slice of libibverbs' stable user-space ABI that mooncake uses, declared here so the
 * package builds with only gcc and the Python headers (no libibverbs-dev).
 *
 * Every struct mirrors rdma-core's <infiniband/verbs.h> field for field (names prefixed
 * ``mcv_`` so this header and the real one can be compiled side by side: tests/test_verbs_abi.py
 * checks sizeof/offsetof of each field against the real header where it is installed).
 * Only the *public prefix* of each object is declared: libibverbs and its providers allocate
 * larger private structs whose first member is this one, so we never allocate these ourselves
 * except for the plain argument structs (wr, sge, wc, attrs).
 *
 * ibv_post_send / ibv_post_recv / ibv_poll_cq / ibv_req_notify_cq are static inline functions
 * in verbs.h that jump through ``context->ops``; we do the same through mcv_context_ops.
 */
#ifndef MC_VERBS_ABI_H
#define MC_VERBS_ABI_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define MCV_SYSFS_NAME_MAX 64
#define MCV_SYSFS_PATH_MAX 256

struct mcv_context;
struct mcv_pd;
struct mcv_cq;
struct mcv_qp;
struct mcv_send_wr;
struct mcv_recv_wr;
struct mcv_wc;

union mcv_gid {
    uint8_t raw[16];
    struct {
        uint64_t subnet_prefix; /* big-endian */
        uint64_t interface_id;  /* big-endian */
    } global;
};

struct mcv_device_ops {
    struct mcv_context *(*_dummy1)(void *device, int cmd_fd);
    void (*_dummy2)(struct mcv_context *context);
};

struct mcv_device {
    struct mcv_device_ops _ops;
    int node_type;      /* enum ibv_node_type */
    int transport_type; /* enum ibv_transport_type */
    char name[MCV_SYSFS_NAME_MAX];
    char dev_name[MCV_SYSFS_NAME_MAX];
    char dev_path[MCV_SYSFS_PATH_MAX];
    char ibdev_path[MCV_SYSFS_PATH_MAX];
};

struct mcv_context_ops {
    void *_compat_query_device;
    void *_compat_query_port;
    void *_compat_alloc_pd;
    void *_compat_dealloc_pd;
    void *_compat_reg_mr;
    void *_compat_rereg_mr;
    void *_compat_dereg_mr;
    void *alloc_mw;
    void *bind_mw;
    void *dealloc_mw;
    void *_compat_create_cq;
    int (*poll_cq)(struct mcv_cq *cq, int num_entries, struct mcv_wc *wc);
    int (*req_notify_cq)(struct mcv_cq *cq, int solicited_only);
    void *_compat_cq_event;
    void *_compat_resize_cq;
    void *_compat_destroy_cq;
    void *_compat_create_srq;
    void *_compat_modify_srq;
    void *_compat_query_srq;
    void *_compat_destroy_srq;
    void *post_srq_recv;
    void *_compat_create_qp;
    void *_compat_query_qp;
    void *_compat_modify_qp;
    void *_compat_destroy_qp;
    int (*post_send)(struct mcv_qp *qp, struct mcv_send_wr *wr, struct mcv_send_wr **bad_wr);
    int (*post_recv)(struct mcv_qp *qp, struct mcv_recv_wr *wr, struct mcv_recv_wr **bad_wr);
    void *_compat_create_ah;
    void *_compat_destroy_ah;
    void *_compat_attach_mcast;
    void *_compat_detach_mcast;
    void *_compat_async_event;
};

struct mcv_context {
    struct mcv_device *device;
    struct mcv_context_ops ops;
    int cmd_fd;
    int async_fd;
    int num_comp_vectors;
    pthread_mutex_t mutex;
    void *abi_compat;
};

struct mcv_device_attr {
    char fw_ver[64];
    uint64_t node_guid;
    uint64_t sys_image_guid;
    uint64_t max_mr_size;
    uint64_t page_size_cap;
    uint32_t vendor_id;
    uint32_t vendor_part_id;
    uint32_t hw_ver;
    int max_qp;
    int max_qp_wr;
    unsigned int device_cap_flags;
    int max_sge;
    int max_sge_rd;
    int max_cq;
    int max_cqe;
    int max_mr;
    int max_pd;
    int max_qp_rd_atom;
    int max_ee_rd_atom;
    int max_res_rd_atom;
    int max_qp_init_rd_atom;
    int max_ee_init_rd_atom;
    int atomic_cap;
    int max_ee;
    int max_rdd;
    int max_mw;
    int max_raw_ipv6_qp;
    int max_raw_ethy_qp;
    int max_mcast_grp;
    int max_mcast_qp_attach;
    int max_total_mcast_qp_attach;
    int max_ah;
    int max_fmr;
    int max_map_per_fmr;
    int max_srq;
    int max_srq_wr;
    int max_srq_sge;
    uint16_t max_pkeys;
    uint8_t local_ca_ack_delay;
    uint8_t phys_port_cnt;
};

/* The exported ibv_query_port (IBVERBS_1.1) fills the "compat" prefix, up to ``flags``; the
 * trailing port_cap_flags2 is written only by the verbs_context path. Callers zero the struct. */
struct mcv_port_attr {
    int state;      /* enum ibv_port_state */
    int max_mtu;    /* enum ibv_mtu */
    int active_mtu; /* enum ibv_mtu */
    int gid_tbl_len;
    uint32_t port_cap_flags;
    uint32_t max_msg_sz;
    uint32_t bad_pkey_cntr;
    uint32_t qkey_viol_cntr;
    uint16_t pkey_tbl_len;
    uint16_t lid;
    uint16_t sm_lid;
    uint8_t lmc;
    uint8_t max_vl_num;
    uint8_t sm_sl;
    uint8_t subnet_timeout;
    uint8_t init_type_reply;
    uint8_t active_width;
    uint8_t active_speed;
    uint8_t phys_state;
    uint8_t link_layer;
    uint8_t flags;
    uint16_t port_cap_flags2;
};

struct mcv_pd {
    struct mcv_context *context;
    uint32_t handle;
};

struct mcv_mr {
    struct mcv_context *context;
    struct mcv_pd *pd;
    void *addr;
    size_t length;
    uint32_t handle;
    uint32_t lkey;
    uint32_t rkey;
};

struct mcv_comp_channel {
    struct mcv_context *context;
    int fd;
    int refcnt;
};

struct mcv_cq {
    struct mcv_context *context;
    struct mcv_comp_channel *channel;
    void *cq_context;
    uint32_t handle;
    int cqe;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t comp_events_completed;
    uint32_t async_events_completed;
};

struct mcv_qp {
    struct mcv_context *context;
    void *qp_context;
    struct mcv_pd *pd;
    struct mcv_cq *send_cq;
    struct mcv_cq *recv_cq;
    void *srq;
    uint32_t handle;
    uint32_t qp_num;
    int state;   /* enum ibv_qp_state */
    int qp_type; /* enum ibv_qp_type */
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t events_completed;
};

struct mcv_qp_cap {
    uint32_t max_send_wr;
    uint32_t max_recv_wr;
    uint32_t max_send_sge;
    uint32_t max_recv_sge;
    uint32_t max_inline_data;
};

struct mcv_qp_init_attr {
    void *qp_context;
    struct mcv_cq *send_cq;
    struct mcv_cq *recv_cq;
    void *srq;
    struct mcv_qp_cap cap;
    int qp_type; /* enum ibv_qp_type */
    int sq_sig_all;
};

struct mcv_global_route {
    union mcv_gid dgid;
    uint32_t flow_label;
    uint8_t sgid_index;
    uint8_t hop_limit;
    uint8_t traffic_class;
};

struct mcv_ah_attr {
    struct mcv_global_route grh;
    uint16_t dlid;
    uint8_t sl;
    uint8_t src_path_bits;
    uint8_t static_rate;
    uint8_t is_global;
    uint8_t port_num;
};

struct mcv_qp_attr {
    int qp_state;       /* enum ibv_qp_state */
    int cur_qp_state;   /* enum ibv_qp_state */
    int path_mtu;       /* enum ibv_mtu */
    int path_mig_state; /* enum ibv_mig_state */
    uint32_t qkey;
    uint32_t rq_psn;
    uint32_t sq_psn;
    uint32_t dest_qp_num;
    unsigned int qp_access_flags;
    struct mcv_qp_cap cap;
    struct mcv_ah_attr ah_attr;
    struct mcv_ah_attr alt_ah_attr;
    uint16_t pkey_index;
    uint16_t alt_pkey_index;
    uint8_t en_sqd_async_notify;
    uint8_t sq_draining;
    uint8_t max_rd_atomic;
    uint8_t max_dest_rd_atomic;
    uint8_t min_rnr_timer;
    uint8_t port_num;
    uint8_t timeout;
    uint8_t retry_cnt;
    uint8_t rnr_retry;
    uint8_t alt_port_num;
    uint8_t alt_timeout;
    uint32_t rate_limit;
};

struct mcv_sge {
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
};

struct mcv_mw_bind_info {
    struct mcv_mr *mr;
    uint64_t addr;
    uint64_t length;
    unsigned int mw_access_flags;
};

struct mcv_send_wr {
    uint64_t wr_id;
    struct mcv_send_wr *next;
    struct mcv_sge *sg_list;
    int num_sge;
    int opcode; /* enum ibv_wr_opcode */
    unsigned int send_flags;
    union {
        uint32_t imm_data; /* big-endian */
        uint32_t invalidate_rkey;
    };
    union {
        struct {
            uint64_t remote_addr;
            uint32_t rkey;
        } rdma;
        struct {
            uint64_t remote_addr;
            uint64_t compare_add;
            uint64_t swap;
            uint32_t rkey;
        } atomic;
        struct {
            void *ah;
            uint32_t remote_qpn;
            uint32_t remote_qkey;
        } ud;
    } wr;
    union {
        struct {
            uint32_t remote_srqn;
        } xrc;
    } qp_type;
    union {
        struct {
            void *mw;
            uint32_t rkey;
            struct mcv_mw_bind_info bind_info;
        } bind_mw;
        struct {
            void *hdr;
            uint16_t hdr_sz;
            uint16_t mss;
        } tso;
    };
};

struct mcv_recv_wr {
    uint64_t wr_id;
    struct mcv_recv_wr *next;
    struct mcv_sge *sg_list;
    int num_sge;
};

struct mcv_wc {
    uint64_t wr_id;
    int status; /* enum ibv_wc_status */
    int opcode; /* enum ibv_wc_opcode */
    uint32_t vendor_err;
    uint32_t byte_len;
    union {
        uint32_t imm_data; /* big-endian */
        uint32_t invalidated_rkey;
    };
    uint32_t qp_num;
    uint32_t src_qp;
    unsigned int wc_flags;
    uint16_t pkey_index;
    uint16_t slid;
    uint8_t sl;
    uint8_t dlid_path_bits;
};

/* enum values (rdma-core verbs.h; stable since libibverbs 1.1) */
enum {
    MCV_NODE_CA = 1,
    MCV_TRANSPORT_IB = 0,

    MCV_QPT_RC = 2,

    MCV_QPS_RESET = 0,
    MCV_QPS_INIT = 1,
    MCV_QPS_RTR = 2,
    MCV_QPS_RTS = 3,
    MCV_QPS_SQD = 4,
    MCV_QPS_SQE = 5,
    MCV_QPS_ERR = 6,

    MCV_QP_STATE = 1 << 0,
    MCV_QP_CUR_STATE = 1 << 1,
    MCV_QP_ACCESS_FLAGS = 1 << 3,
    MCV_QP_PKEY_INDEX = 1 << 4,
    MCV_QP_AV = 1 << 7,
    MCV_QP_PATH_MTU = 1 << 8,
    MCV_QP_TIMEOUT = 1 << 9,
    MCV_QP_RETRY_CNT = 1 << 10,
    MCV_QP_RNR_RETRY = 1 << 11,
    MCV_QP_RQ_PSN = 1 << 12,
    MCV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
    MCV_QP_MIN_RNR_TIMER = 1 << 15,
    MCV_QP_SQ_PSN = 1 << 16,
    MCV_QP_MAX_DEST_RD_ATOMIC = 1 << 17,
    MCV_QP_PORT = 1 << 5,
    MCV_QP_DEST_QPN = 1 << 20,

    MCV_ACCESS_LOCAL_WRITE = 1,
    MCV_ACCESS_REMOTE_WRITE = 2,
    MCV_ACCESS_REMOTE_READ = 4,
    MCV_ACCESS_REMOTE_ATOMIC = 8,
    MCV_ACCESS_RELAXED_ORDERING = 1 << 20,

    MCV_WR_RDMA_WRITE = 0,
    MCV_WR_RDMA_WRITE_WITH_IMM = 1,
    MCV_WR_SEND = 2,
    MCV_WR_RDMA_READ = 4,

    MCV_SEND_FENCE = 1,
    MCV_SEND_SIGNALED = 2,
    MCV_SEND_SOLICITED = 4,
    MCV_SEND_INLINE = 8,

    MCV_WC_RDMA_WRITE = 1,
    MCV_WC_RDMA_READ = 2,

    MCV_WC_SUCCESS = 0,
    MCV_WC_LOC_LEN_ERR = 1,
    MCV_WC_LOC_QP_OP_ERR = 2,
    MCV_WC_LOC_PROT_ERR = 4,
    MCV_WC_WR_FLUSH_ERR = 5,
    MCV_WC_LOC_ACCESS_ERR = 8,
    MCV_WC_REM_INV_REQ_ERR = 9,
    MCV_WC_REM_ACCESS_ERR = 10,
    MCV_WC_REM_OP_ERR = 11,
    MCV_WC_RETRY_EXC_ERR = 12,
    MCV_WC_RNR_RETRY_EXC_ERR = 13,
    MCV_WC_FATAL_ERR = 19,
    MCV_WC_GENERAL_ERR = 21,

    MCV_PORT_DOWN = 1,
    MCV_PORT_ACTIVE = 4,

    MCV_LINK_LAYER_INFINIBAND = 1,
    MCV_LINK_LAYER_ETHERNET = 2,

    MCV_MTU_256 = 1,
    MCV_MTU_1024 = 3,
    MCV_MTU_4096 = 5,
};

#endif /* MC_VERBS_ABI_H */
