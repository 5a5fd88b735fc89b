// The Python module acarerank._cpu. Its ops live in the other csrc/cpu/*.cpp files and register
// with the dispatcher when this library is loaded (torch.ops.acarerank.*); the module itself only
// reports how it was built, so acarerank/ops/_native.py can refuse a torch it was not built for.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <pybind11/pybind11.h>

#include <cstring>

#include "attn_amx.h"
#include "attn_tiles.h"
#include "layer_glue.h"

#ifndef ACARERANK_TORCH_VERSION
#define ACARERANK_TORCH_VERSION "unknown"
#endif

namespace py = pybind11;

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "acarerank native CPU kernels (torch.ops.acarerank.*), linked against libtorch";
  m.def("build_info", [] {
    py::dict d;
    d["torch_version"] = ACARERANK_TORCH_VERSION;  // the torch whose headers and libtorch it was built with
    d["cxx11_abi"] = static_cast<int>(_GLIBCXX_USE_CXX11_ABI);
#ifdef _OPENMP
    d["openmp"] = true;
#else
    d["openmp"] = false;
#endif
    return d;
  }, "How this module was built: torch_version, cxx11_abi, openmp.");
  m.def("could_pack_bf16", [] { return at::native::cpublas::could_pack(at::kBFloat16); },
        "Whether cpublas::brgemm has a fast (VNNI-packed, AVX512_BF16/AMX) bf16 path on this CPU.");
  m.def("bf16_logits_gemm", [] {
    return acr_attn::cpu_has_avx512_bf16() && !acr_attn::cpu_baseline_forced() &&
           std::strcmp(acr_attn::bf16_path(), "fp32-convert") != 0;
  }, "Whether the ops' bf16 logits chunks run mm_bf16_f32 here: AVX512_BF16 (brgemm on AMX), not "
     "ACARERANK_CPU_BASELINE=1, not ACARERANK_CPU_BF16_PATH=fp32-convert.");
  m.def("bf16_attention_path", [] { return std::string(acr_attn::bf16_path()); },
        "The bf16 compute path of the attention kernel: amx-brgemm, avx512-bf16, fp32-convert or brgemm.");
  m.def("amx_tiles_kernel", [] {
#ifdef ACR_HAVE_AMX_CODE
    return acr_attn::amx_tiles_kernel();
#else
    return false;
#endif
  }, "Whether the attention's bf16 key tiles run on AMX tiles directly with the softmax interleaved (attn_amx.h): "
     "the amx-brgemm path where this process may use the tiles and head_dim % 32 == 0, unless "
     "ACARERANK_CPU_AMX_TILES=0.");
  m.def("layer_kernel_isa", [] { return std::string(acr_layer::isa_name(acarerank_cpu::checked_layer_isa())); },
        "The build of the element-wise row kernels this process runs: avx512, avx2 or baseline.");
  m.def("tile_keys", [] { return acr_attn::kTileKeys; },
        "Keys per tile of the attention kernel's tile path: its batch-invariant alignment.");
  m.def("num_threads", [] { return at::get_num_threads(); }, "at::get_num_threads() as the kernels see it.");
}
