# cython: language_level=3
from mooncake._fast._ibv cimport mcv_pd
from mooncake._fast._verbs_device cimport Context
from mooncake._fast._verbs_lib cimport Resource

cdef class PD(Resource):
    cdef mcv_pd *pd
    cdef readonly Context context
