// mlakv tests (CUDA builds): a CUDA graph captured from a stream, and what its nodes launch.
#pragma once

#include <cuda_runtime.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "cuda/cuda_utils.h"

namespace mlakv {
namespace test {

// A CUDA graph captured from what `enqueue` puts into the stream.
class CapturedGraph {
 public:
  CapturedGraph(cudaStream_t stream, const std::function<void()>& enqueue) {
    MLAKV_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue();
    } catch (...) {
      cudaStreamEndCapture(stream, &graph_);  // leave the stream usable; the error is the throw
      if (graph_ != nullptr) cudaGraphDestroy(graph_);
      throw;
    }
    MLAKV_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    MLAKV_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CapturedGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  // Capture turns a PDL launch into a programmatic edge; a full edge instead would make the graph
  // replays below pass whether the op waits or not.
  int64_t num_programmatic_edges() const {
    size_t num_edges = 0;
    MLAKV_CUDA_CHECK(cudaGraphGetEdges(graph_, nullptr, nullptr, nullptr, &num_edges));
    std::vector<cudaGraphNode_t> from(num_edges), to(num_edges);
    std::vector<cudaGraphEdgeData> data(num_edges);
    MLAKV_CUDA_CHECK(cudaGraphGetEdges(graph_, from.data(), to.data(), data.data(), &num_edges));
    return std::count_if(data.begin(), data.end(), [](const cudaGraphEdgeData& e) {
      return e.type == cudaGraphDependencyTypeProgrammatic;
    });
  }

  // The kernels of the graph's kernel nodes, in node order, each as its demangled signature
  // ("void mlakv::cuda::k<float, true>(...)"): which template instance a launcher chose.
  std::vector<std::string> kernel_names() const {
    size_t num_nodes = 0;
    MLAKV_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &num_nodes));
    std::vector<cudaGraphNode_t> nodes(num_nodes);
    MLAKV_CUDA_CHECK(cudaGraphGetNodes(graph_, nodes.data(), &num_nodes));
    std::vector<std::string> names;
    for (cudaGraphNode_t node : nodes) {
      cudaGraphNodeType type;
      MLAKV_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
      if (type != cudaGraphNodeTypeKernel) continue;
      cudaKernelNodeParams params = {};
      MLAKV_CUDA_CHECK(cudaGraphKernelNodeGetParams(node, &params));
      const char* mangled = nullptr;
      MLAKV_CUDA_CHECK(cudaFuncGetName(&mangled, params.func));
      int status = 0;
      char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
      names.emplace_back(status == 0 && demangled != nullptr ? demangled : mangled);
      std::free(demangled);
    }
    return names;
  }

  void launch(cudaStream_t stream) const { MLAKV_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace test
}  // namespace mlakv
