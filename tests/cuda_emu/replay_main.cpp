// Replays a recorded sequence of kernel launches (tests/cuda_emu/__init__.py: Recorder) in a standalone
// executable, so the emulation can run under ThreadSanitizer (a TSan-instrumented library cannot be loaded
// into an uninstrumented Python). Usage: emu_replay IN OUT. Linked with the emulated kernels' objects.
//
// IN:  "RPEMU1", u32 nbuf, nbuf x (u64 nbytes, bytes), u32 nlaunch, nlaunch x (u32 namelen, name,
//      u32 grid[3], u32 block[3], u64 smem, u32 nargs, nargs x (u8 kind: 0 scalar -> u32 size, size bytes;
//      1 buffer -> u32 id, u64 byte offset)).
// OUT: u32 nbuf, nbuf x (u64 nbytes, bytes): every buffer after the last launch.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, unsigned long long smem_bytes, void** params, int nparams);

namespace {

struct Reader {
    FILE* f;
    template <class T>
    T get() {
        T v{};
        if (std::fread(&v, sizeof(T), 1, f) != 1) throw std::string("truncated input");
        return v;
    }
    void bytes(void* dst, size_t n) {
        if (n && std::fread(dst, 1, n, f) != n) throw std::string("truncated input");
    }
};

int run(const char* in_path, const char* out_path) {
    FILE* in = std::fopen(in_path, "rb");
    if (!in) throw std::string("cannot open ") + in_path;
    Reader r{in};
    char magic[6];
    r.bytes(magic, 6);
    if (std::memcmp(magic, "RPEMU1", 6) != 0) throw std::string("bad magic");
    const unsigned nbuf = r.get<unsigned>();
    std::vector<std::vector<unsigned char>> bufs(nbuf);
    for (auto& b : bufs) {
        b.resize(r.get<unsigned long long>() + 16);
        r.bytes(b.data(), b.size() - 16);
    }
    const unsigned nlaunch = r.get<unsigned>();
    for (unsigned l = 0; l < nlaunch; ++l) {
        std::string name(r.get<unsigned>(), '\0');
        r.bytes(&name[0], name.size());
        unsigned g[3], b[3];
        for (auto& x : g) x = r.get<unsigned>();
        for (auto& x : b) x = r.get<unsigned>();
        const unsigned long long smem = r.get<unsigned long long>();
        const unsigned nargs = r.get<unsigned>();
        std::vector<unsigned long long> storage(nargs);  // scalars and pointers, 8 bytes each
        std::vector<void*> params(nargs);
        for (unsigned a = 0; a < nargs; ++a) {
            if (r.get<unsigned char>() == 0) {
                const unsigned size = r.get<unsigned>();
                if (size > 8) throw std::string("scalar over 8 bytes");
                r.bytes(&storage[a], size);
            } else {
                const unsigned id = r.get<unsigned>();
                const unsigned long long off = r.get<unsigned long long>();
                if (id >= nbuf) throw std::string("bad buffer id");
                unsigned char* p = bufs[id].data() + off;
                std::memcpy(&storage[a], &p, sizeof(p));
            }
            params[a] = &storage[a];
        }
        const int rc = emu_launch(name.c_str(), g[0], g[1], g[2], b[0], b[1], b[2], smem, params.data(), (int)nargs);
        if (rc != 0) throw "launch of " + name + " failed with " + std::to_string(rc);
    }
    std::fclose(in);
    FILE* out = std::fopen(out_path, "wb");
    if (!out) throw std::string("cannot open ") + out_path;
    std::fwrite(&nbuf, sizeof(nbuf), 1, out);
    for (auto& b : bufs) {
        const unsigned long long n = b.size() - 16;
        std::fwrite(&n, sizeof(n), 1, out);
        std::fwrite(b.data(), 1, n, out);
    }
    std::fclose(out);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
        return 2;
    }
    try {
        return run(argv[1], argv[2]);
    } catch (const std::string& e) {
        std::fprintf(stderr, "emu_replay: %s\n", e.c_str());
        return 1;
    }
}
