/* Our kernels as torch operators (quant_cpu::block_matmul, block_rows, decode_attention; add_rms_norm and silu_mul,
 * the eager forward's only): a compiled decode step calls them through torch's dispatcher in about 3 us each, where a
 * Python custom op around the ctypes call took 15-17 us (121 matmuls per SmolLM2 step: ~2 ms of a ~5 ms step). The
 * ISA libraries (quant_<isa>.c) stay plain C; this file only finds their entry points (dlopen, once per library) and
 * hands them tensors' memory. Built by kernels/cpu_quant.py with the C++ compiler against the installed torch's
 * headers, cached under a name that carries its source's digest and torch's version (a different torch builds its
 * own). */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <unordered_map>

namespace {

typedef int (*matmul_fn)(int, int, const float *, int, int, const uint8_t *, int, float *, int);
typedef int (*rows_fn)(int, const uint8_t *, int, int, const int64_t *, int, float *);
typedef int (*norm_fn)(float *, const float *, const float *, long, long, float, float *, int);
typedef int (*silu_fn)(const float *, long, long, float *, int);
typedef int (*attention_fn)(const float *, int, int, int, int, const void *, const void *, int, long, long, long,
                            const int64_t *, const int64_t *, float *, int);

void *symbol(const std::string &library, const std::string &name) {
    static std::mutex lock;
    static std::unordered_map<std::string, void *> found;
    std::lock_guard<std::mutex> guard(lock);
    const std::string key = library + '\0' + name;
    auto it = found.find(key);
    if (it != found.end()) return it->second;
    void *handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(handle, "cannot load ", library, ": ", dlerror());
    void *fn = dlsym(handle, name.c_str());
    TORCH_CHECK(fn, "no ", name, " in ", library);
    found[key] = fn;
    return fn;
}

at::Tensor block_matmul(const at::Tensor &x, const at::Tensor &data, int64_t fmt, int64_t n,
                        const std::string &library, const std::string &isa, bool exact) {
    TORCH_CHECK(x.dim() == 2 && data.scalar_type() == at::kByte && data.is_contiguous(), "block_matmul: bad arguments");
    const at::Tensor xc = x.to(at::kFloat).contiguous();
    at::Tensor y = at::empty({xc.size(0), n}, xc.options());
    const auto fn = reinterpret_cast<matmul_fn>(symbol(library, isa + "_matmul"));
    const int rc = fn((int)fmt, exact ? 1 : 0, xc.data_ptr<float>(), (int)xc.size(0), (int)xc.size(1),
                      data.data_ptr<uint8_t>(), (int)n, y.data_ptr<float>(), at::get_num_threads());
    TORCH_CHECK(rc == 0, "block_matmul failed (", rc, ") for a (", xc.size(0), ", ", xc.size(1), ") input");
    return y;
}

at::Tensor block_rows(const at::Tensor &data, int64_t fmt, int64_t n, int64_t k, const at::Tensor &ids,
                      const std::string &library, const std::string &isa) {
    const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
    at::Tensor out = at::empty({flat.numel(), k}, data.options().dtype(at::kFloat));
    const auto fn = reinterpret_cast<rows_fn>(symbol(library, isa + "_rows"));
    const int rc = fn((int)fmt, data.data_ptr<uint8_t>(), (int)n, (int)k, flat.data_ptr<int64_t>(), (int)flat.numel(),
                      out.data_ptr<float>());
    TORCH_CHECK(rc == 0, "block_rows failed (", rc, "): an id outside 0..", n - 1);
    return out;
}

/* q (B, n_heads, hd); k_cache, v_cache (slots, n_kv, positions, hd) float32 or bfloat16, a position's values
 * contiguous (a layer's view of the KV cache); each row attends over its slot's positions 0..positions[b] ->
 * (B, n_heads * hd) float32. */
at::Tensor decode_attention(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,
                            const at::Tensor &slot_ids, const at::Tensor &positions, const std::string &library,
                            const std::string &isa) {
    TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                    v_cache.strides() == k_cache.strides() && k_cache.scalar_type() == v_cache.scalar_type() &&
                    (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16) &&
                    k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) && q.size(2) == k_cache.size(3),
                "decode_attention: bad arguments");
    const at::Tensor qc = q.to(at::kFloat).contiguous();
    const at::Tensor slots = slot_ids.to(at::kLong).contiguous(), pos = positions.to(at::kLong).contiguous();
    TORCH_CHECK(slots.numel() == qc.size(0) && pos.numel() == qc.size(0),
                "decode_attention: one slot and position a row");
    const auto n_slots = k_cache.size(0);
    for (int64_t r = 0; r < slots.numel(); r++)
        TORCH_CHECK(slots.data_ptr<int64_t>()[r] >= 0 && slots.data_ptr<int64_t>()[r] < n_slots,
                    "decode_attention: a slot outside 0..", n_slots - 1);
    at::Tensor out = at::empty({qc.size(0), qc.size(1) * qc.size(2)}, qc.options());
    const auto fn = reinterpret_cast<attention_fn>(symbol(library, isa + "_decode_attention"));
    const int rc = fn(qc.data_ptr<float>(), (int)qc.size(0), (int)qc.size(1), (int)k_cache.size(1), (int)qc.size(2),
                      k_cache.data_ptr(), v_cache.data_ptr(), k_cache.scalar_type() == at::kBFloat16 ? 1 : 0,
                      (long)k_cache.stride(0), (long)k_cache.stride(1), (long)k_cache.size(2),
                      slots.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), out.data_ptr<float>(), at::get_num_threads());
    TORCH_CHECK(rc == 0, "decode_attention failed (", rc, ")");
    return out;
}

/* h (rows, dim) float32, contiguous: h += delta in place (where given); returns RMSNorm(h) * weight. The eager
 * forward's op only (never traced: no fake, no functional form). */
at::Tensor add_rms_norm(at::Tensor &h, const std::optional<at::Tensor> &delta, const at::Tensor &weight, double eps,
                        const std::string &library, const std::string &isa) {
    const bool with_delta = delta.has_value() && delta->defined();
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous() &&
                    weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == h.size(1) &&
                    (!with_delta || (delta->scalar_type() == at::kFloat && delta->is_contiguous() &&
                                     delta->sizes() == h.sizes())),
                "add_rms_norm: bad arguments");
    at::Tensor out = at::empty_like(h);
    const auto fn = reinterpret_cast<norm_fn>(symbol(library, isa + "_add_rms_norm"));
    const int rc = fn(h.data_ptr<float>(), with_delta ? delta->data_ptr<float>() : nullptr, weight.data_ptr<float>(),
                      (long)h.size(0), (long)h.size(1), (float)eps, out.data_ptr<float>(), at::get_num_threads());
    TORCH_CHECK(rc == 0, "add_rms_norm failed (", rc, ")");
    return out;
}

/* gate_up (rows, 2 * inter) float32, contiguous -> (rows, inter) SiLU(gate) * up. */
at::Tensor silu_mul(const at::Tensor &gate_up, const std::string &library, const std::string &isa) {
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() &&
                    gate_up.size(1) % 2 == 0,
                "silu_mul: bad arguments");
    const int64_t inter = gate_up.size(1) / 2;
    at::Tensor out = at::empty({gate_up.size(0), inter}, gate_up.options());
    const auto fn = reinterpret_cast<silu_fn>(symbol(library, isa + "_silu_mul"));
    const int rc = fn(gate_up.data_ptr<float>(), (long)gate_up.size(0), (long)inter, out.data_ptr<float>(),
                      at::get_num_threads());
    TORCH_CHECK(rc == 0, "silu_mul failed (", rc, ")");
    return out;
}

}  // namespace

TORCH_LIBRARY(quant_cpu, m) {
    m.def("block_matmul(Tensor x, Tensor data, int fmt, int n, str library, str isa, bool exact) -> Tensor");
    m.def("block_rows(Tensor data, int fmt, int n, int k, Tensor ids, str library, str isa) -> Tensor");
    m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot_ids, Tensor positions, str library, "
          "str isa) -> Tensor");
    m.def("add_rms_norm(Tensor(a!) h, Tensor? delta, Tensor weight, float eps, str library, str isa) -> Tensor");
    m.def("silu_mul(Tensor gate_up, str library, str isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(quant_cpu, CPU, m) {
    m.impl("block_matmul", block_matmul);
    m.impl("block_rows", block_rows);
    m.impl("decode_attention", decode_attention);
    m.impl("add_rms_norm", add_rms_norm);
    m.impl("silu_mul", silu_mul);
}
