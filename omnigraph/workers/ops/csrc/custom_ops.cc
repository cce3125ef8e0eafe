// ONNX Runtime glue for the omnigraph custom ops (domain "omnigraph"): attribute and shape
// validation, output allocation through ORT, and dispatch to the CPU (FP32) or CUDA (BF16/FP16)
// kernels. Built against the ORT 1.21 headers with ORT_API_MANUAL_INIT so that one library loads
// into any later ORT (the C API is backward compatible).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstdint>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"

#define OMNIGRAPH_EXPORT extern "C" __attribute__((visibility("default")))

namespace omnigraph {
namespace {

constexpr const char* kDomain = "omnigraph";

// A bad attribute, shape or type: reported to ORT as ORT_INVALID_ARGUMENT with this message.
class OpInputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Runs `body`, turning every exception into an OrtStatus carrying the op name and the message.
template <typename Body>
OrtStatusPtr Guarded(const char* op_name, Body&& body) {
  try {
    body();
    return nullptr;
  } catch (const OpInputError& error) {
    return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, (std::string(op_name) + ": " + error.what()).c_str());
  } catch (const Ort::Exception& error) {
    return Ort::GetApi().CreateStatus(error.GetOrtErrorCode(), (std::string(op_name) + ": " + error.what()).c_str());
  } catch (const std::exception& error) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, (std::string(op_name) + ": " + error.what()).c_str());
  }
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::ostringstream text;
  text << "[";
  for (size_t i = 0; i < shape.size(); ++i) text << (i ? ", " : "") << shape[i];
  text << "]";
  return text.str();
}

void Require(bool condition, const std::string& message) {
  if (!condition) throw OpInputError(message);
}

// An attribute's value; nullopt only when the node does not set it (a wrong type is an error,
// never a silent default). ORT reports both as ORT_FAIL; its message tells them apart, and should
// that text ever change, a missing optional attribute fails loudly rather than defaulting.
template <typename T>
std::optional<T> OptionalAttribute(const Ort::ConstKernelInfo& info, const char* name, const char* type_name) {
  try {
    return info.GetAttribute<T>(name);
  } catch (const Ort::Exception& error) {
    if (std::string(error.what()).find("No attribute with name") != std::string::npos) return std::nullopt;
    throw OpInputError(std::string("attribute '") + name + "' must be " + type_name + " (" + error.what() + ")");
  }
}

template <typename T>
T RequiredAttribute(const Ort::ConstKernelInfo& info, const char* name, const char* type_name) {
  std::optional<T> value = OptionalAttribute<T>(info, name, type_name);
  if (!value) throw OpInputError(std::string("missing required attribute '") + name + "' (" + type_name + ")");
  return *value;
}

// Where a kernel runs and which activation element type it takes.
enum class Backend { kCpu, kCudaBFloat16, kCudaFloat16 };

constexpr ONNXTensorElementDataType ActivationType(Backend backend) {
  return backend == Backend::kCpu            ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
         : backend == Backend::kCudaBFloat16 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16
                                             : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}

constexpr const char* ProviderType(Backend backend) {
  return backend == Backend::kCpu ? "CPUExecutionProvider" : "CUDAExecutionProvider";
}

#ifdef OMNIGRAPH_OPS_WITH_CUDA
constexpr DeviceFloat DeviceType(Backend backend) {
  return backend == Backend::kCudaBFloat16 ? DeviceFloat::kBFloat16 : DeviceFloat::kFloat16;
}

void CheckCuda(int error, const char* what) {
  if (error != 0) throw std::runtime_error(std::string(what) + " failed: " + CudaErrorString(error));
}
#endif

// ------------------------------------------------------------------------------------------------
// ModernBertAttention(qkv [B, L, 3d], key_mask int64 [B, L]) -> context [B, L, d]
// attributes: num_heads (int, required), window (int, default 0 = global), rope_theta (float, required)
template <Backend backend>
struct AttentionKernel {
  explicit AttentionKernel(const OrtKernelInfo* info_ptr) {
    Ort::ConstKernelInfo info(info_ptr);
    num_heads = RequiredAttribute<int64_t>(info, "num_heads", "an int");
    window = OptionalAttribute<int64_t>(info, "window", "an int").value_or(0);
    rope_theta = RequiredAttribute<float>(info, "rope_theta", "a float");
    Require(num_heads > 0, "attribute num_heads must be positive, got " + std::to_string(num_heads));
    Require(window >= 0, "attribute window must be >= 0 (0 = global), got " + std::to_string(window));
    Require(rope_theta > 0.0f, "attribute rope_theta must be positive, got " + std::to_string(rope_theta));
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context_ptr) {
    return Guarded("ModernBertAttention", [&] { Compute(Ort::KernelContext(context_ptr)); });
  }

  void Compute(Ort::KernelContext context) {
    const Ort::ConstValue qkv = context.GetInput(0);
    const Ort::ConstValue mask = context.GetInput(1);
    const std::vector<int64_t> qkv_shape = qkv.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> mask_shape = mask.GetTensorTypeAndShapeInfo().GetShape();
    Require(qkv_shape.size() == 3, "qkv must be [B, L, 3*d], got " + ShapeText(qkv_shape));
    Require(qkv_shape[2] % 3 == 0, "qkv's last dimension must be 3*d, got " + std::to_string(qkv_shape[2]));
    const int64_t model_dim = qkv_shape[2] / 3;
    Require(model_dim % num_heads == 0, "d=" + std::to_string(model_dim) + " is not divisible by num_heads=" +
                                            std::to_string(num_heads));
    const int64_t head_dim = model_dim / num_heads;
    Require(head_dim % 2 == 0, "head dimension must be even for rotary embedding, got " + std::to_string(head_dim));
    Require(mask_shape == std::vector<int64_t>{qkv_shape[0], qkv_shape[1]},
            "key_mask must be [B, L] = " + ShapeText({qkv_shape[0], qkv_shape[1]}) + ", got " + ShapeText(mask_shape));
    const AttentionShape shape{qkv_shape[0], qkv_shape[1], num_heads, head_dim, window, rope_theta};
    Ort::UnownedValue out = context.GetOutput(0, {qkv_shape[0], qkv_shape[1], model_dim});
    if constexpr (backend == Backend::kCpu) {
      AttentionCpu(qkv.GetTensorData<float>(), mask.GetTensorData<int64_t>(), out.GetTensorMutableData<float>(), shape);
    } else {
#ifdef OMNIGRAPH_OPS_WITH_CUDA
      Require(AttentionCudaSupportsHeadDim(head_dim),
              "the CUDA kernel supports head dimensions 32, 64 and 128, got " + std::to_string(head_dim));
      CheckCuda(AttentionCuda(DeviceType(backend), qkv.GetTensorRawData(), mask.GetTensorData<int64_t>(),
                              out.GetTensorMutableRawData(), shape, context.GetGPUComputeStream()),
                "ModernBertAttention kernel launch");
#endif
    }
  }

  int64_t num_heads;
  int64_t window;
  float rope_theta;
};

// ------------------------------------------------------------------------------------------------
// GeGLU(x [..., 2F]) -> gelu_erf(x[..., :F]) * x[..., F:]  [..., F]
template <Backend backend>
struct GegluKernel {
  explicit GegluKernel(const OrtKernelInfo*) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* context_ptr) {
    return Guarded("GeGLU", [&] { Compute(Ort::KernelContext(context_ptr)); });
  }

  void Compute(Ort::KernelContext context) {
    const Ort::ConstValue x = context.GetInput(0);
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    Require(!shape.empty(), "input must have at least one dimension");
    Require(shape.back() % 2 == 0, "input's last dimension must be even (2F), got " + ShapeText(shape));
    const int64_t features = shape.back() / 2;
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    shape.back() = features;
    Ort::UnownedValue out = context.GetOutput(0, shape);
    if constexpr (backend == Backend::kCpu) {
      GegluCpu(x.GetTensorData<float>(), out.GetTensorMutableData<float>(), rows, features);
    } else {
#ifdef OMNIGRAPH_OPS_WITH_CUDA
      CheckCuda(GegluCuda(DeviceType(backend), x.GetTensorRawData(), out.GetTensorMutableRawData(), rows, features,
                          context.GetGPUComputeStream()),
                "GeGLU kernel launch");
#endif
    }
  }
};

// ------------------------------------------------------------------------------------------------
// AddLayerNorm(residual float [..., d], x [..., d], weight float [d]) ->
//   (residual + x) float [..., d], LayerNorm(residual + x) * weight [..., d]
// attribute: epsilon (float, default 1e-5)
template <Backend backend>
struct AddLayerNormKernel {
  explicit AddLayerNormKernel(const OrtKernelInfo* info_ptr) {
    Ort::ConstKernelInfo info(info_ptr);
    epsilon = OptionalAttribute<float>(info, "epsilon", "a float").value_or(1e-5f);
    Require(epsilon > 0.0f, "attribute epsilon must be positive, got " + std::to_string(epsilon));
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context_ptr) {
    return Guarded("AddLayerNorm", [&] { Compute(Ort::KernelContext(context_ptr)); });
  }

  void Compute(Ort::KernelContext context) {
    const Ort::ConstValue residual = context.GetInput(0);
    const Ort::ConstValue x = context.GetInput(1);
    const Ort::ConstValue weight = context.GetInput(2);
    const std::vector<int64_t> shape = residual.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> x_shape = x.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> weight_shape = weight.GetTensorTypeAndShapeInfo().GetShape();
    Require(!shape.empty(), "residual must have at least one dimension");
    Require(x_shape == shape, "x must have the residual's shape " + ShapeText(shape) + ", got " + ShapeText(x_shape));
    const int64_t dim = shape.back();
    Require(weight_shape == std::vector<int64_t>{dim},
            "weight must be [" + std::to_string(dim) + "], got " + ShapeText(weight_shape));
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    Ort::UnownedValue residual_out = context.GetOutput(0, shape);
    Ort::UnownedValue normed = context.GetOutput(1, shape);
    if constexpr (backend == Backend::kCpu) {
      AddLayerNormCpu(residual.GetTensorData<float>(), x.GetTensorData<float>(), weight.GetTensorData<float>(),
                      residual_out.GetTensorMutableData<float>(), normed.GetTensorMutableData<float>(), rows, dim,
                      epsilon);
    } else {
#ifdef OMNIGRAPH_OPS_WITH_CUDA
      CheckCuda(AddLayerNormCuda(DeviceType(backend), residual.GetTensorData<float>(), x.GetTensorRawData(),
                                 weight.GetTensorData<float>(), residual_out.GetTensorMutableData<float>(),
                                 normed.GetTensorMutableRawData(), rows, dim, epsilon, context.GetGPUComputeStream()),
                "AddLayerNorm kernel launch");
#endif
    }
  }

  float epsilon;
};

// ------------------------------------------------------------------------------------------------
// Op definitions: one per (op, backend); ORT merges same-named ops into one schema and picks the
// kernel by execution provider and input types.
template <typename Kernel, typename Derived>
struct OpBase : Ort::CustomOpBase<Derived, Kernel, /*WithStatus=*/true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return Guarded(static_cast<const Derived*>(this)->GetName(), [&] { *kernel = new Kernel(info); });
  }
};

template <Backend backend>
struct AttentionOp : OpBase<AttentionKernel<backend>, AttentionOp<backend>> {
  const char* GetName() const { return "ModernBertAttention"; }
  const char* GetExecutionProviderType() const { return ProviderType(backend); }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 0 ? ActivationType(backend) : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ActivationType(backend); }
};

template <Backend backend>
struct GegluOp : OpBase<GegluKernel<backend>, GegluOp<backend>> {
  const char* GetName() const { return "GeGLU"; }
  const char* GetExecutionProviderType() const { return ProviderType(backend); }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ActivationType(backend); }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ActivationType(backend); }
};

template <Backend backend>
struct AddLayerNormOp : OpBase<AddLayerNormKernel<backend>, AddLayerNormOp<backend>> {
  const char* GetName() const { return "AddLayerNorm"; }
  const char* GetExecutionProviderType() const { return ProviderType(backend); }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 1 ? ActivationType(backend) : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t index) const {
    return index == 1 ? ActivationType(backend) : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

template <Backend backend>
struct BackendOps {
  AttentionOp<backend> attention;
  GegluOp<backend> geglu;
  AddLayerNormOp<backend> add_layer_norm;

  void AddTo(Ort::CustomOpDomain& domain) {
    domain.Add(&attention);
    domain.Add(&geglu);
    domain.Add(&add_layer_norm);
  }
};

// Domains must outlive every session registered with them: kept for the process's lifetime.
std::mutex registered_mutex;
std::vector<Ort::CustomOpDomain>& RegisteredDomains() {
  static auto* domains = new std::vector<Ort::CustomOpDomain>();
  return *domains;
}

void Register(OrtSessionOptions* options) {
  static BackendOps<Backend::kCpu> cpu_ops;
#ifdef OMNIGRAPH_OPS_WITH_CUDA
  static BackendOps<Backend::kCudaBFloat16> cuda_bf16_ops;
  static BackendOps<Backend::kCudaFloat16> cuda_fp16_ops;
#endif
  Ort::CustomOpDomain domain{kDomain};
  cpu_ops.AddTo(domain);
#ifdef OMNIGRAPH_OPS_WITH_CUDA
  cuda_bf16_ops.AddTo(domain);
  cuda_fp16_ops.AddTo(domain);
#endif
  Ort::UnownedSessionOptions(options).Add(domain);
  std::lock_guard<std::mutex> lock(registered_mutex);
  RegisteredDomains().push_back(std::move(domain));
}

}  // namespace
}  // namespace omnigraph

// The ABI version of this library (see kernels.h), checked by the loader against the manifest.
OMNIGRAPH_EXPORT int OmnigraphOpsAbiVersion() { return omnigraph::kAbiVersion; }

// 1 when the CUDA kernels are compiled in, 0 for the CPU-only build.
OMNIGRAPH_EXPORT int OmnigraphOpsHasCuda() {
#ifdef OMNIGRAPH_OPS_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

OMNIGRAPH_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    const std::string message = std::string("omnigraph ops need ONNX Runtime API version >= ") +
                                std::to_string(ORT_API_VERSION) + ", this runtime is " + api_base->GetVersionString();
    return api_base->GetApi(1)->CreateStatus(ORT_FAIL, message.c_str());
  }
  Ort::InitApi(api);
  return omnigraph::Guarded("RegisterCustomOps", [&] { omnigraph::Register(options); });
}
