// The plan of one step: made once from the step's tree (structure and lengths, tree.hpp), run once per
// layer with that layer's K/V (cpu::run, cuda::Workspace). It holds no K/V pointers:
//
//   tree        the step's segments (lengths), sequences and their query rows, as given;
//   attended    the tree the schedule runs: the given tree, or auto's regrouping of it (auto.hpp), whose
//               segments ("slots") each read the K/V of one given segment, source(k);
//   schedule    passes, work items and merge lists for the target backend (schedule.hpp);
//   workspace   the floats of partial state one run needs (workspace_floats()).
//
// Making a plan costs about as much as walking the tree and its rows, once per step for every layer (what it
// takes: docs/study.md §6); running it costs the attention itself. A plan is a value: copy it, keep it, run
// it from several threads at once.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "cascade/auto.hpp"
#include "cascade/dtype.hpp"
#include "cascade/schedule.hpp"
#include "cascade/tree.hpp"

namespace cascade {

class Plan {
 public:
  Plan() = default;

  // The plan of `tree` for `target`. With a cost model, auto first regroups the tree where a shared pass
  // is predicted not to pay (auto.hpp; kv_dtype: the K/V element type it prices).
  static Plan make(Tree tree, const Target& target, const CostModel* model = nullptr, DType kv_dtype = DType::f16) {
    Plan p;
    p.tree_ = std::move(tree);
    p.target_ = target;
    if (model) {
      Regrouping r = choose(p.tree_, *model, target, kv_dtype);
      p.choice_ = std::move(r.why);
      p.regrouped_ = std::move(r.tree);
      p.source_ = std::move(r.source);
    }
    p.schedule_ = make_schedule(p.attended(), target);
    return p;
  }

  const Tree& tree() const { return tree_; }
  const Tree& attended() const { return regrouped_ ? *regrouped_ : tree_; }
  // The given tree's segment whose K/V segment k of attended() reads.
  int source(int k) const { return regrouped_ ? source_[size_t(k)] : k; }
  const Schedule& schedule() const { return schedule_; }
  const Target& target() const { return target_; }
  // auto's decision, when the plan was made with a cost model.
  const std::optional<AutoChoice>& choice() const { return choice_; }
  // Floats of partial state one run needs: o (n_slots, head_dim) then lse (n_slots).
  int64_t workspace_floats() const { return schedule_.workspace_floats(tree_.shape().head_dim); }

  const HeadShape& shape() const { return tree_.shape(); }
  float scale() const { return tree_.scale(); }
  int64_t n_rows() const { return tree_.n_rows(); }
  int n_segments() const { return tree_.n_segments(); }
  int n_sequences() const { return tree_.n_sequences(); }

 private:
  Tree tree_;
  std::optional<Tree> regrouped_;
  std::vector<int> source_;
  Target target_;
  Schedule schedule_;
  std::optional<AutoChoice> choice_;
};

}  // namespace cascade
