// Every TensorRT AOT plugin kernel in one translation unit, so one PTX per target carries them all
// (pipeline/engine/ptx.py): the sampler (dg_sampler.cu, found through -I pipeline/sampler/kernels/csrc)
// and the routed experts (dg_moe.cu, beside this file).
#include "dg_sampler.cu"
#include "dg_moe.cu"
