# cython: language_level=3
from mooncake._fast._ibv cimport mcv_context
from mooncake._fast._verbs_lib cimport Resource

cdef class Context(Resource):
    cdef mcv_context *ctx
    cdef readonly str name
