// The step profiler's spin (engine/profile.rs): one thread reads the global timer (ns) until
// `ns` have passed, touching no memory, so that the host can queue the next operation and
// the events around it while the GPU waits here, and the events then time the operation alone.
extern "C" __global__ void spin_wait(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while ((long long)(now - start) < ns);
}
