/* The quantized matmuls of quant_kernels.h for CPUs with AVX-512 (F, BW, VL) and VNNI: 16 outputs per 512-bit
 * vector, `vpdpbusd` multiplying 4 weight bytes by 4 activation bytes into each int32 lane. Built by
 * kernels/cpu_quant.py with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c; chosen only
 * where cpuid reports those features and the OS saves the 512-bit state. */
#define ISA avx512vnni
#include "quant_vec512.h"

#include "quant_kernels.h"
