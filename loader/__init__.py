"""Loading a model's files into what models/ computes with, and what the machine learns about them: reading and
caching the weights (weights, weight_cache, file_digest), compiling the decode step (compiled_decode) and measuring
which matmul path runs fastest here (path_choice, path_build). models/ only computes; this layer writes files, forks
the compiler and times the machine. It imports models/ and kernels/, never appliance/."""
