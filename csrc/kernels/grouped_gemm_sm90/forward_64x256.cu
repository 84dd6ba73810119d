// One instance of the experts' grouped GEMM (instances.h lists them all).
#include "../grouped_gemm_sm90.cuh"

HASTEN_GROUPED_GEMM_SM90_INSTANCE(kForward, k64x256PingPong)
