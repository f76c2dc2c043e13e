"""A ggml RPC server on one port serving the CPU backend, for tests: it gives this
GPU-less machine a second device whose memory is not host memory, so partial offload
really splits the model across devices. Usage: python rpc_server.py HOST:PORT"""
import ctypes
import os
import sys

if len(sys.argv) != 2 or ":" not in sys.argv[1]:
    sys.exit("usage: python rpc_server.py HOST:PORT")

import llama_cpp  # noqa: E402  (after the usage check: loading the libraries takes a while)

lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
ggml = ctypes.CDLL(os.path.join(lib_dir, "libggml.so"), mode=ctypes.RTLD_GLOBAL)
rpc = ctypes.CDLL(os.path.join(lib_dir, "libggml-rpc.so"), mode=ctypes.RTLD_GLOBAL)
ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                              ctypes.c_size_t, ctypes.c_void_p]
devices = (ctypes.c_void_p * 1)(ggml.ggml_backend_dev_by_type(0))  # GGML_BACKEND_DEVICE_TYPE_CPU
rpc.ggml_backend_rpc_start_server(sys.argv[1].encode(), None, 1, 1, devices)
