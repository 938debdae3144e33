# The compiled codec's decoder, declared for the modules that cimport it (the receive core in
# _ext/receive.pyx): its fields and C methods. The implementation is _ext/codec.pyx.
from libc.stdint cimport uint8_t


cdef class FrameDecoder:
    cdef public object max_payload
    cdef public object allocate
    cdef public bint require_checksum
    cdef Py_ssize_t _initial_payload
    cdef bytearray _buf
    cdef memoryview _view
    cdef Py_ssize_t _start
    cdef Py_ssize_t _end
    cdef object _header
    cdef object _dest            # memoryview handed out in frames
    cdef uint8_t[::1] _destmv    # the same memory, typed, for memcpy
    cdef Py_ssize_t _destcap     # its size: the payload length, or less while the decoder owns it
    cdef Py_ssize_t _length      # the payload's announced length
    cdef bint _owned             # the decoder allocated _dest (it grows) rather than `allocate`
    cdef Py_ssize_t _filled
    cdef bint _lent_dest
    cdef bint _checking          # the frame in progress carries a payload CRC32C
    cdef object _crc             # CRC32C of its payload bytes received so far
    cdef object _error

    cpdef get_buffer(self, Py_ssize_t sizehint=*)
    cpdef buffer_updated(self, Py_ssize_t nbytes)
    cpdef next_frame(self)
    cdef _reserve(self, Py_ssize_t n)
    cdef _own(self, Py_ssize_t size)
    cdef _room(self, Py_ssize_t n)
    cdef _set_destination(self, header)
    cdef object _destination_for(self, header)
