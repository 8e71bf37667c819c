# cython: language_level=3
"""libibverbs ABI declarations (from csrc/mc_verbs_abi.h; no libibverbs-dev needed)."""

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "mc_verbs_abi.h" nogil:
    union mcv_gid:
        uint8_t raw[16]

    struct mcv_device:
        int node_type
        int transport_type
        char name[64]
        char ibdev_path[256]

    struct mcv_cq
    struct mcv_qp
    struct mcv_wc
    struct mcv_send_wr
    struct mcv_recv_wr

    struct mcv_context_ops:
        int (*poll_cq)(mcv_cq *cq, int num_entries, mcv_wc *wc) noexcept nogil
        int (*req_notify_cq)(mcv_cq *cq, int solicited_only) noexcept nogil
        int (*post_send)(mcv_qp *qp, mcv_send_wr *wr, mcv_send_wr **bad_wr) noexcept nogil
        int (*post_recv)(mcv_qp *qp, mcv_recv_wr *wr, mcv_recv_wr **bad_wr) noexcept nogil

    struct mcv_context:
        mcv_device *device
        mcv_context_ops ops
        int num_comp_vectors

    struct mcv_device_attr:
        char fw_ver[64]
        uint64_t node_guid
        uint64_t max_mr_size
        uint32_t vendor_id
        uint32_t vendor_part_id
        int max_qp
        int max_qp_wr
        int max_sge
        int max_cq
        int max_cqe
        int max_mr
        int max_qp_rd_atom
        int max_qp_init_rd_atom
        uint8_t phys_port_cnt

    struct mcv_port_attr:
        int state
        int max_mtu
        int active_mtu
        int gid_tbl_len
        uint32_t max_msg_sz
        uint16_t lid
        uint8_t active_width
        uint8_t active_speed
        uint8_t link_layer

    struct mcv_pd:
        mcv_context *context
        uint32_t handle

    struct mcv_mr:
        mcv_context *context
        mcv_pd *pd
        void *addr
        size_t length
        uint32_t lkey
        uint32_t rkey

    struct mcv_comp_channel:
        mcv_context *context
        int fd

    struct mcv_cq:
        mcv_context *context
        mcv_comp_channel *channel
        void *cq_context
        int cqe

    struct mcv_qp:
        mcv_context *context
        mcv_pd *pd
        uint32_t qp_num
        int state

    struct mcv_qp_cap:
        uint32_t max_send_wr
        uint32_t max_recv_wr
        uint32_t max_send_sge
        uint32_t max_recv_sge
        uint32_t max_inline_data

    struct mcv_qp_init_attr:
        void *qp_context
        mcv_cq *send_cq
        mcv_cq *recv_cq
        void *srq
        mcv_qp_cap cap
        int qp_type
        int sq_sig_all

    struct mcv_global_route:
        mcv_gid dgid
        uint32_t flow_label
        uint8_t sgid_index
        uint8_t hop_limit
        uint8_t traffic_class

    struct mcv_ah_attr:
        mcv_global_route grh
        uint16_t dlid
        uint8_t sl
        uint8_t src_path_bits
        uint8_t static_rate
        uint8_t is_global
        uint8_t port_num

    struct mcv_qp_attr:
        int qp_state
        int cur_qp_state
        int path_mtu
        uint32_t qkey
        uint32_t rq_psn
        uint32_t sq_psn
        uint32_t dest_qp_num
        unsigned int qp_access_flags
        mcv_qp_cap cap
        mcv_ah_attr ah_attr
        uint16_t pkey_index
        uint8_t max_rd_atomic
        uint8_t max_dest_rd_atomic
        uint8_t min_rnr_timer
        uint8_t port_num
        uint8_t timeout
        uint8_t retry_cnt
        uint8_t rnr_retry

    struct mcv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey

    struct _mcv_rdma:
        uint64_t remote_addr
        uint32_t rkey

    union _mcv_wr_union:
        _mcv_rdma rdma

    struct mcv_send_wr:
        uint64_t wr_id
        mcv_send_wr *next
        mcv_sge *sg_list
        int num_sge
        int opcode
        unsigned int send_flags
        _mcv_wr_union wr

    struct mcv_wc:
        uint64_t wr_id
        int status
        int opcode
        uint32_t vendor_err
        uint32_t byte_len
        uint32_t qp_num

    enum:
        MCV_QPT_RC
        MCV_QPS_RESET
        MCV_QPS_INIT
        MCV_QPS_RTR
        MCV_QPS_RTS
        MCV_QPS_ERR
        MCV_QP_STATE
        MCV_QP_ACCESS_FLAGS
        MCV_QP_PKEY_INDEX
        MCV_QP_PORT
        MCV_QP_AV
        MCV_QP_PATH_MTU
        MCV_QP_TIMEOUT
        MCV_QP_RETRY_CNT
        MCV_QP_RNR_RETRY
        MCV_QP_RQ_PSN
        MCV_QP_MAX_QP_RD_ATOMIC
        MCV_QP_MIN_RNR_TIMER
        MCV_QP_SQ_PSN
        MCV_QP_MAX_DEST_RD_ATOMIC
        MCV_QP_DEST_QPN
        MCV_ACCESS_LOCAL_WRITE
        MCV_ACCESS_REMOTE_WRITE
        MCV_ACCESS_REMOTE_READ
        MCV_WR_RDMA_WRITE
        MCV_WR_RDMA_READ
        MCV_SEND_SIGNALED
        MCV_WC_SUCCESS


# The entry points we resolve with dlsym (the inline verbs go through mcv_context.ops).
ctypedef mcv_device ** (*ibv_get_device_list_t)(int *num) noexcept nogil
ctypedef void (*ibv_free_device_list_t)(mcv_device **lst) noexcept nogil
ctypedef const char * (*ibv_get_device_name_t)(mcv_device *dev) noexcept nogil
ctypedef mcv_context * (*ibv_open_device_t)(mcv_device *dev) noexcept nogil
ctypedef int (*ibv_close_device_t)(mcv_context *ctx) noexcept nogil
ctypedef int (*ibv_query_device_t)(mcv_context *ctx, mcv_device_attr *attr) noexcept nogil
ctypedef int (*ibv_query_port_t)(mcv_context *ctx, uint8_t port, mcv_port_attr *attr) noexcept nogil
ctypedef int (*ibv_query_gid_t)(mcv_context *ctx, uint8_t port, int index, mcv_gid *gid) noexcept nogil
ctypedef mcv_pd * (*ibv_alloc_pd_t)(mcv_context *ctx) noexcept nogil
ctypedef int (*ibv_dealloc_pd_t)(mcv_pd *pd) noexcept nogil
ctypedef mcv_mr * (*ibv_reg_mr_t)(mcv_pd *pd, void *addr, size_t length, int access) noexcept nogil
ctypedef int (*ibv_dereg_mr_t)(mcv_mr *mr) noexcept nogil
ctypedef mcv_comp_channel * (*ibv_create_comp_channel_t)(mcv_context *ctx) noexcept nogil
ctypedef int (*ibv_destroy_comp_channel_t)(mcv_comp_channel *ch) noexcept nogil
ctypedef mcv_cq * (*ibv_create_cq_t)(mcv_context *ctx, int cqe, void *cq_context, mcv_comp_channel *ch, int comp_vector) noexcept nogil
ctypedef int (*ibv_destroy_cq_t)(mcv_cq *cq) noexcept nogil
ctypedef int (*ibv_get_cq_event_t)(mcv_comp_channel *ch, mcv_cq **cq, void **cq_context) noexcept nogil
ctypedef void (*ibv_ack_cq_events_t)(mcv_cq *cq, unsigned int n) noexcept nogil
ctypedef mcv_qp * (*ibv_create_qp_t)(mcv_pd *pd, mcv_qp_init_attr *attr) noexcept nogil
ctypedef int (*ibv_modify_qp_t)(mcv_qp *qp, mcv_qp_attr *attr, int mask) noexcept nogil
ctypedef int (*ibv_destroy_qp_t)(mcv_qp *qp) noexcept nogil

ctypedef struct IbvApi:
    ibv_get_device_list_t get_device_list
    ibv_free_device_list_t free_device_list
    ibv_get_device_name_t get_device_name
    ibv_open_device_t open_device
    ibv_close_device_t close_device
    ibv_query_device_t query_device
    ibv_query_port_t query_port
    ibv_query_gid_t query_gid
    ibv_alloc_pd_t alloc_pd
    ibv_dealloc_pd_t dealloc_pd
    ibv_reg_mr_t reg_mr
    ibv_dereg_mr_t dereg_mr
    ibv_create_comp_channel_t create_comp_channel
    ibv_destroy_comp_channel_t destroy_comp_channel
    ibv_create_cq_t create_cq
    ibv_destroy_cq_t destroy_cq
    ibv_get_cq_event_t get_cq_event
    ibv_ack_cq_events_t ack_cq_events
    ibv_create_qp_t create_qp
    ibv_modify_qp_t modify_qp
    ibv_destroy_qp_t destroy_qp
