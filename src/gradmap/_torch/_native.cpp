// gradmap's native boundary walk (NOTE [the native walk] in _native.py).
//
// walk(outputs, lo, hi) reads a chunk's boundary off the graph its forward built in the calling
// thread, and gates every edge from the chunk to a node made elsewhere. It makes no Python
// object per node: only the boundary's entries reach Python. (The module also holds the
// processes executor's byte comparison of kept items, same_bytes, at the end.)
#include <ATen/record_function.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/tensor.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <typeinfo>
#include <limits>
#include <memory>
#include <type_traits>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace py = pybind11;
using torch::autograd::AccumulateGrad;
using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::InputMetadata;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// A node of the chunk's own between its nodes and a node made outside the chunk (a leaf's
// AccumulateGrad, or a non-leaf made before the call). It passes gradients through. A chunk
// pullback asks for the gates' gradients: the engine captures them there and, since nothing it
// was asked for lies behind a gate, runs nothing beyond (NOTE [the native walk]).
struct Gate final : Node {
  Gate(Edge to, const InputMetadata& meta)
      : Node(std::numeric_limits<uint64_t>::max(), edge_list{std::move(to)}) {
    input_metadata_.push_back(meta);
  }

  variable_list apply(variable_list&& grads) override {
    return std::move(grads);
  }

  std::string name() const override {
    return "gradmap::Gate";
  }
};

// Nodes are held by std::shared_ptr up to torch 2.12 and by c10::intrusive_ptr after.
using NodePtr = decltype(std::declval<Edge>().function);

template <class P = NodePtr>
P make_gate(Edge to, const InputMetadata& meta) {
  if constexpr (std::is_same_v<P, std::shared_ptr<Node>>) {
    return std::make_shared<Gate>(std::move(to), meta);
  } else {
    return c10::make_intrusive<Gate>(std::move(to), meta);
  }
}

template <class T>
std::shared_ptr<T> strong(const std::weak_ptr<T>& p) {
  return p.lock();
}

template <class T>
const c10::intrusive_ptr<T>& strong(const c10::intrusive_ptr<T>& p) {
  return p;
}

// Whether ``node`` is a custom Function's. (By its type's name: libtorch_python does not export
// PyNode's type info, so no dynamic_cast; the Itanium ABI's name, which GCC and Clang give.)
bool custom_function(Node* node) {
  return std::strcmp(typeid(*node).name(), "N5torch8autograd6PyNodeE") == 0;
}

// Whether the backward of ``node`` may not be linear in its incoming gradient, or does more than
// compute: a hook on it or on a tensor it made (``register_hook``, ``retain_grad``), or a custom
// Function's backward (NOTE [chunks whose backward is user code] in _graph.py).
bool user_backward(Node* node) {
  return !node->tensor_pre_hooks().empty() || !node->retains_grad_hooks().empty() ||
      !node->pre_hooks().empty() || !node->post_hooks().empty() || custom_function(node);
}

// Whether the gradient ``edge`` carries is of a floating type of 16 bits or fewer (half,
// bfloat16, float8, complex half): NOTE [gradients of reduced precision] in _graph.py.
bool reduced_precision(const Edge& edge) {
  auto type = c10::typeMetaToScalarType(edge.function->input_metadata(edge.input_nr).dtype());
  return at::isReducedFloatingType(type) || type == at::kComplexHalf;
}

bool is_inner(const Node* node, uint64_t thread, uint64_t lo, uint64_t hi) {
  auto nr = node->sequence_nr();
  return node->thread_id() == thread && lo <= nr && nr < hi;
}

at::Tensor stand_in(const InputMetadata& meta) {
  TORCH_CHECK(
      !meta.is_nested_tensor(),
      "gradmap: f uses a nested tensor made before the call, which the join cannot take as an "
      "input; pass it as an item instead");
  auto shape = C10_AS_INTARRAYREF_SLOW(meta.shape_as_dim_vector());
  return at::zeros({}, meta.options()).expand(shape);
}

struct Entry {
  intptr_t key;  // the leaf's TensorImpl, or the outside node
  int64_t nr;  // -1 for a leaf, else the edge's input number
  at::Tensor tensor;  // the join's input: the leaf, or a stand-in on the outside edge
  at::Tensor input;  // what the chunk's autograd.grad takes: the leaf, or a tensor on its gate
};

// Where an edge of the chunk lies: the edge ``index`` of ``node`` (an output when null).
struct Place {
  Node* node;
  size_t index;
};

struct Walk {
  uint64_t thread, lo, hi;
  std::vector<Entry> entries;
  std::unordered_map<const Node*, size_t> leaf_entries;  // by accumulator
  std::unordered_set<const Node*> plain_leaves;  // accumulators without hooks, met before
  std::map<std::pair<const Node*, uint32_t>, NodePtr> gates;
  // The inner nodes reached, by sequence number (each number is one node's, made in this
  // thread in [lo, hi)); a node whose slot holds another node goes to ``seen_else``. A slot
  // per number costs less than a hashed set's allocation per node (a GRU's graph: 0.26 ->
  // 0.1 us per node).
  std::vector<const Node*> seen;
  std::unordered_set<const Node*> seen_else;
  std::vector<Node*> stack;
  // Every inner node reached, held until the walk ends: the addresses in ``stack``, ``seen``
  // and ``to_leaves`` stay those of live nodes whoever else lets go of them meanwhile.
  std::vector<NodePtr> held;
  std::vector<Place> to_leaves;  // edges to leaves, gated only if the chunk has non-leaf edges
  bool non_leaf = false;
  // The accumulators of leaves the chunk returns as they are. A leaf holds its accumulator
  // weakly: one that no graph holds is made anew by each gradient_edge(), so a leaf returned
  // twice would get two (entries keyed by accumulator: two entries, its gradient counted
  // twice). Held here, every output that is that leaf finds the same one.
  std::vector<NodePtr> returned;
  bool user = false;  // an inner node runs user code in its backward (``user_backward``)
  bool reduced = false;  // an edge carries a gradient of reduced precision

  // Whether the inner node ``node`` is reached for the first time (and is now seen).
  bool first_sight(const Node* node) {
    auto& slot = seen[node->sequence_nr() - lo];
    if (slot == nullptr) {
      slot = node;
      return true;
    }
    if (slot == node) {
      return false;
    }
    return seen_else.insert(node).second;
  }

  // The gate for the outside edge (node, nr), made on first sight (with its boundary entry, or
  // on the leaf's entry).
  NodePtr gate(const NodePtr& node, uint32_t nr) {
    auto& g = gates[{node.get(), nr}];
    if (!g) {
      const auto& meta = node->input_metadata(nr);
      g = make_gate(Edge(node, nr), meta);
      if (auto* acc = dynamic_cast<AccumulateGrad*>(node.get())) {
        entries[leaf(acc)].input = torch::autograd::make_variable(acc->variable, Edge(g, 0));
      } else {
        auto data = stand_in(meta);
        entries.push_back(
            {reinterpret_cast<intptr_t>(node.get()),
             static_cast<int64_t>(nr),
             torch::autograd::make_variable(data, Edge(node, nr)),
             torch::autograd::make_variable(data, Edge(g, 0))});
        non_leaf = true;
      }
    }
    return g;
  }

  // The entry of the leaf ``acc`` accumulates into, made on first sight.
  size_t leaf(AccumulateGrad* acc) {
    auto [it, made] = leaf_entries.emplace(acc, entries.size());
    if (made) {
      const auto& v = acc->variable;
      entries.push_back({reinterpret_cast<intptr_t>(v.unsafeGetTensorImpl()), -1, v, v});
    }
    return it->second;
  }

  // Whether an edge leads out of the chunk and must be gated now; an inner node is queued, and
  // an edge to a leaf without hooks is noted at ``place`` (gated at the end if need be).
  bool leaves_chunk(const Edge& edge, Place place) {
    if (!reduced && reduced_precision(edge)) {
      reduced = true;
    }
    Node* child = edge.function.get();
    if (is_inner(child, thread, lo, hi)) {
      if (first_sight(child)) {
        held.push_back(edge.function);
        stack.push_back(child);
      }
      return false;
    }
    if (plain_leaves.count(child) != 0) {  // a leaf without hooks met before
      to_leaves.push_back(place);
      return false;
    }
    if (auto* acc = dynamic_cast<AccumulateGrad*>(child)) {
      if (!acc->variable.defined()) {
        return false;  // a released accumulator takes nothing: left as it is
      }
      if (!torch::autograd::impl::hooks(acc->variable).empty()) {
        return true;  // captured there, its hooks would run in the pullback
      }
      leaf(acc);
      plain_leaves.insert(child);
      to_leaves.push_back(place);
      return false;
    }
    return true;
  }
};

// Point the edge at ``place`` to ``to`` (keeping a CopySlices node's inner node in step).
void rewire(Place place, Edge to) {
  auto& next = place.node->next_edges();
  next[place.index] = to;
  // An in-place write into a view (``buffer[i] = y``) keeps the in-place op's node inside its
  // CopySlices node, whose edges past the first must stay the same as its own.
  auto* copy = dynamic_cast<torch::autograd::CopySlices*>(place.node);
  if (copy != nullptr && place.index > 0 && copy->fn &&
      place.index < copy->fn->next_edges().size()) {
    copy->fn->next_edges()[place.index] = std::move(to);
  }
}

py::tuple walk(const std::vector<at::Tensor>& outputs, uint64_t lo, uint64_t hi) {
  Walk w{at::RecordFunction::currentThreadId(), lo, hi};
  w.seen.assign(hi > lo ? hi - lo : 0, nullptr);
  std::vector<std::pair<size_t, at::Tensor>> roots;  // outputs replaced by a gated alias
  {
    py::gil_scoped_release no_gil;  // the walk touches no Python object
    std::vector<size_t> leaf_roots;  // outputs that are leaves without hooks
    for (size_t i = 0; i < outputs.size(); ++i) {
      const auto& t = outputs[i];
      auto edge = torch::autograd::impl::gradient_edge(t);  // a leaf's accumulator, if a leaf
      if (!edge.function) {
        continue;
      }
      if (!t.grad_fn()) {
        w.returned.push_back(edge.function);
      }
      auto noted = w.to_leaves.size();
      if (w.leaves_chunk(edge, Place{nullptr, i})) {
        auto g = w.gate(edge.function, edge.input_nr);
        roots.emplace_back(i, torch::autograd::make_variable(t, Edge(g, 0)));
      } else if (w.to_leaves.size() > noted) {
        w.to_leaves.pop_back();
        leaf_roots.push_back(i);
      }
    }
    while (!w.stack.empty()) {
      Node* node = w.stack.back();
      w.stack.pop_back();
      if (!w.user && user_backward(node)) {
        w.user = true;
      }
      auto& next = node->next_edges();
      for (size_t i = 0; i < next.size(); ++i) {
        const auto& edge = next[i];
        if (edge.is_valid() && w.leaves_chunk(edge, Place{node, i})) {
          rewire(Place{node, i}, Edge(w.gate(edge.function, edge.input_nr), 0));
        }
      }
    }
    // NOTE [leaves gated only past a non-leaf]: an edge to a leaf needs no gate unless the chunk
    // also reaches a non-leaf made elsewhere: asked for at its accumulator, the leaf would make
    // the engine run the graph behind that non-leaf's gate to reach it (through the tensor made
    // from it), counting that path twice. Otherwise nothing lies behind a leaf to run.
    if (w.non_leaf) {
      for (const auto& place : w.to_leaves) {
        const auto& edge = place.node->next_edges()[place.index];
        rewire(place, Edge(w.gate(edge.function, edge.input_nr), 0));
      }
      for (auto i : leaf_roots) {
        auto edge = torch::autograd::impl::gradient_edge(outputs[i]);
        auto g = w.gate(edge.function, edge.input_nr);
        roots.emplace_back(i, torch::autograd::make_variable(outputs[i], Edge(g, 0)));
      }
    }
  }
  py::list keys, tensors, inputs, replaced;
  for (auto& e : w.entries) {
    // A leaf's key is its TensorImpl's address alone: no tuple per leaf (a map over items that
    // require grad has one entry per element, each object one more for the collector).
    if (e.nr < 0) {
      keys.append(py::int_(e.key));
    } else {
      keys.append(py::make_tuple(e.key, e.nr));
    }
    tensors.append(std::move(e.tensor));
    inputs.append(std::move(e.input));
  }
  for (auto& [i, t] : roots) {
    replaced.append(py::make_tuple(i, std::move(t)));
  }
  return py::make_tuple(keys, tensors, inputs, replaced, w.user, w.reduced);
}

// For each of a walked chunk's boundary inputs (tensors on its gates' edges), whether the graph
// from ``outputs`` reaches it: which gradients a cotangent of zeros would have made zeros.
//
// Every node whose address is kept (a key of ``gates``, on ``stack``, in ``seen``) is held in
// ``held`` until the end. A leaf holds its accumulator weakly: for a leaf no graph holds it for
// (one ``f`` returned as it is, read by nothing else), gradient_edge() makes a new one, owned by
// the Edge alone, which the next look replaces and so frees. Were they let go, an input and an
// output that are one leaf would get two accumulators (a miss), and a leaf twice among the
// outputs would free the first one's while its address is on the stack (read after it is
// freed: a crash, or a false hit where another node took the address). Held, every look at a
// leaf finds the same accumulator.
std::vector<bool> reaches(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs) {
  std::vector<NodePtr> held;
  std::unordered_map<const Node*, size_t> gates;
  for (size_t k = 0; k < inputs.size(); ++k) {
    auto node = torch::autograd::impl::gradient_edge(inputs[k]).function;
    if (node) {
      gates.emplace(node.get(), k);
      held.push_back(std::move(node));
    }
  }
  std::vector<bool> hit(inputs.size(), false);
  std::unordered_set<const Node*> seen;
  std::vector<Node*> stack;
  auto reach = [&](const NodePtr& node) {
    if (node && seen.insert(node.get()).second) {
      held.push_back(node);
      stack.push_back(node.get());
    }
  };
  py::gil_scoped_release no_gil;
  for (const auto& t : outputs) {
    reach(torch::autograd::impl::gradient_edge(t).function);
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    auto it = gates.find(node);
    if (it != gates.end()) {
      hit[it->second] = true;
      continue;
    }
    if (dynamic_cast<Gate*>(node) != nullptr) {
      continue;  // another chunk's, or another map's: nothing of this boundary behind it
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.is_valid()) {
        reach(edge.function);
      }
    }
  }
  return hit;
}

// For each input of the custom Function node ``ctx`` (a join, in its backward), whether the
// running backward needs its gradient: every one in a plain backward; in autograd.grad or
// backward(inputs=...), those on a path to what was asked for. Read off the node's own edges,
// which an enclosing map's walk may have gated.
std::vector<bool> needed(const py::object& ctx) {
  TORCH_CHECK(THPFunction_Check(ctx.ptr()), "gradmap: needed() takes a custom Function's ctx");
  auto node = strong(reinterpret_cast<THPFunction*>(ctx.ptr())->cdata);
  TORCH_CHECK(node, "gradmap: the join's node is gone");
  const auto& edges = node->next_edges();
  std::vector<bool> out(edges.size(), true);
  const auto* info = torch::autograd::get_current_graph_task_exec_info();
  if (info == nullptr || info->empty()) {
    return out;
  }
  for (size_t k = 0; k < edges.size(); ++k) {
    auto it = info->find(edges[k].function.get());
    out[k] = it != info->end() && it->second.should_execute();
  }
  return out;
}

// Whether the tensors' bytes, one after another, are the ``length`` bytes at ``address``: a kept
// chunk's items against the reference kept with them (NOTE [kept items compared in place] in
// ``_remote/_kept.py``), in one call instead of a Python loop over the tensors. False where a
// tensor's bytes cannot be read in place (``readable_in_place`` there: a contiguous CPU tensor of
// plain layout, without conjugate or negative bits). The tensors are held by the vector while
// the GIL is released; the caller keeps the reference alive.
bool same_bytes(const std::vector<at::Tensor>& tensors, uintptr_t address, size_t length) {
  for (const auto& t : tensors) {
    if (!t.device().is_cpu() || t.layout() != at::kStrided || t.is_quantized() ||
        !t.is_contiguous() || t.is_conj() || t.is_neg()) {
      return false;
    }
  }
  py::gil_scoped_release no_gil;
  const char* reference = reinterpret_cast<const char*>(address);
  size_t offset = 0;
  for (const auto& t : tensors) {
    const size_t size = static_cast<size_t>(t.numel()) * t.element_size();
    if (size > length - offset) {
      return false;
    }
    if (size != 0 && std::memcmp(t.const_data_ptr(), reference + offset, size) != 0) {
      return false;
    }
    offset += size;
  }
  return offset == length;
}

}  // namespace

// The module keeps no state of its own and its functions read no Python object without the GIL,
// so on a free-threaded CPython it says it runs without the GIL: else loading it would turn the
// GIL back on for the whole process (pybind11 2.13 and later; torch's own is 3.0).
#if defined(Py_GIL_DISABLED) && PYBIND11_VERSION_HEX >= 0x020D0000
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m, py::mod_gil_not_used()) {
#else
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#endif
  m.def("walk", &walk, "A chunk's boundary, its edges to non-leaves made elsewhere gated.");
  m.def("reaches", &reaches, "Which boundary inputs the graph from outputs reaches.");
  m.def("needed", &needed, "Which of a join's inputs the running backward needs.");
  m.def("same_bytes", &same_bytes, "Whether tensors' bytes, one after another, are those at an address.");
}
