// Direct calls from a library that AOTInductor compiled (`decoderlm.cpu.decode.step_library`)
// into an op of ours, past its proxy executor.
//
// By default such a library calls a custom op through its proxy executor: the arguments boxed
// into an IValue stack, the dispatcher, the stable ABI's boxing back. Listed in Inductor's
// `aot_inductor.custom_ops_to_c_shims` (`decoderlm.cpu.shims`), the op is called instead as the C
// function aoti_torch_cpu_<op name>, with the C shim ABI of PyTorch's own ops: a tensor as a
// borrowed AtenTensorHandle, an optional one as a pointer to it (null for None), int as int64_t,
// float as double, bool as int32_t, the result written to the last argument. Each ops file defines
// its functions with DECODERLM_SHIM; shims.py writes the same declarations from the ops' schemas.
// The call still shows in torch.profiler under the op's name.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>

namespace decoderlm_shim {

using torch::stable::Tensor;

// A tensor of our own on the caller's borrowed handle (a new handle: the caller keeps its own).
inline Tensor taken(AtenTensorHandle handle) {
  AtenTensorHandle own = nullptr;
  STD_TORCH_CHECK(aoti_torch_new_tensor_handle(handle, &own) == AOTI_TORCH_SUCCESS, "no tensor handle");
  return Tensor(own);
}
inline std::optional<Tensor> taken(AtenTensorHandle *handle) {
  return handle == nullptr ? std::nullopt : std::optional<Tensor>(taken(*handle));
}
inline int64_t taken(int64_t value) { return value; }
inline double taken(double value) { return value; }
inline bool taken(int32_t value) { return value != 0; }

// The op's event in torch.profiler, as the dispatcher records it ("decoderlm::block_linear").
class Event {
 public:
  explicit Event(const char *name) { aoti_record_function_start(name, nullptr, nullptr, 0, &handle_); }
  ~Event() {
    if (handle_ != nullptr) aoti_record_function_end(handle_);
  }
  Event(const Event &) = delete;
  Event &operator=(const Event &) = delete;

 private:
  AtenRecordFunctionHandle handle_ = nullptr;
};

// *result = fn(args…), the arguments converted from the shim ABI; an exception's message printed
// (as AOTInductor prints its own) and AOTI_TORCH_FAILURE returned: no C++ exception crosses the C
// boundary.
template <auto fn, typename... Raw>
AOTITorchError call(const char *name, AtenTensorHandle *result, Raw... raw) noexcept {
  try {
    const Event event(name);
    const Tensor y = fn(taken(raw)...);
    return aoti_torch_new_tensor_handle(y.get(), result);
  } catch (const std::exception &e) {
    std::fprintf(stderr, "Error: %s: %s\n", name, e.what());
    return AOTI_TORCH_FAILURE;
  }
}

}  // namespace decoderlm_shim

// extern "C" AOTITorchError aoti_torch_cpu_NAME(PARAMS…, AtenTensorHandle *ret0), calling FN on
// ARGS (the parameters' names).
#define DECODERLM_SHIM(NAME, FN, PARAMS, ARGS)                                             \
  extern "C" __attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_##NAME(  \
      DECODERLM_UNPAREN PARAMS, AtenTensorHandle *ret0) {                                  \
    return decoderlm_shim::call<FN>("decoderlm::" #NAME, ret0, DECODERLM_UNPAREN ARGS);    \
  }
#define DECODERLM_UNPAREN(...) __VA_ARGS__
