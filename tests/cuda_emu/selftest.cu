// Kernels that exist only to prove the emulation's race detection works (tests/test_cuda_emulated.py):
// each thread writes its slot of shared memory and then reads its neighbour's. With SYNC the
// __syncthreads() in between orders the accesses; without it ThreadSanitizer must report a data race.
template <bool SYNC>
__global__ void neighbour_exchange_kernel(float* out) {
    __shared__ float slots[64];
    const int t = threadIdx.x;
    slots[t] = (float)(t + 1);
    if (SYNC) __syncthreads();
    out[t] = slots[(t + 1) % blockDim.x];
}
