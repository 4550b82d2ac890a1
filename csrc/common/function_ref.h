// FunctionRef<R(Args...)>: a callable passed down to be called before the callee
// returns, never kept. It refers to the caller's lambda (a pointer and a trampoline)
// instead of copying it: a std::function copies a lambda whose captures pass its small
// buffer (two pointers in libstdc++) to the heap, which on the GPU path was a heap
// allocation per NCCL call. Do not store one, nor bind one to a temporary that dies
// before the call.
#pragma once

#include <type_traits>
#include <utility>

namespace spark_hvd {

template <class Sig>
class FunctionRef;

template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  template <class F, class = std::enable_if_t<!std::is_same<std::decay_t<F>, FunctionRef>::value>>
  FunctionRef(F&& f)  // NOLINT(runtime/explicit): as a std::function parameter takes a lambda
      : target_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* t, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(t))(std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(target_, std::forward<Args>(args)...); }

 private:
  void* target_;
  R (*call_)(void*, Args...);
};

}  // namespace spark_hvd
