// PyStore: the rendezvous Store implemented by a Python object (the job's
// rendezvous client, spark_hvd/runner/rendezvous.py) with methods
//   set(key: str, value: bytes), get(key: str, timeout_s: float) -> bytes,
//   wait(keys: list[str], timeout_s: float), and optionally lost_ranks() -> list[int],
//   get_many(keys, timeout_s, watch_lost=...) and set_and_get_many(key, value, keys,
//   timeout_s, watch_lost=...)
// Called from the engine's background thread: takes the GIL for each call.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/status.h"
#include "rendezvous/store.h"

namespace spark_hvd {

class PyStore : public Store {
 public:
  explicit PyStore(pybind11::object client) : client_(std::move(client)) {}
  ~PyStore() override {
    if (Py_IsInitialized()) {
      pybind11::gil_scoped_acquire gil;
      client_ = pybind11::object();
    } else {
      client_.release();  // interpreter gone: leak rather than touch it
    }
  }

  void Set(const std::string& key, const std::string& value) override {
    Call([&] { client_.attr("set")(key, pybind11::bytes(value)); });
  }
  std::string Get(const std::string& key, double timeout_s) override {
    std::string out;
    Call([&] { out = client_.attr("get")(key, timeout_s).cast<std::string>(); });
    return out;
  }
  void Wait(const std::vector<std::string>& keys, double timeout_s) override {
    Call([&] { client_.attr("wait")(keys, timeout_s); });
  }
  // One request (the client's get_many: MGET) where the client has it.
  std::vector<std::string> MultiGet(const std::vector<std::string>& keys, double timeout_s,
                                    bool fail_on_lost) override {
    if (!Has("get_many")) return Store::MultiGet(keys, timeout_s, fail_on_lost);
    std::vector<std::string> out;
    Call([&] {
      out = client_.attr("get_many")(keys, timeout_s, pybind11::arg("watch_lost") = fail_on_lost)
                .cast<std::vector<std::string>>();
    });
    return out;
  }
  std::vector<int> LostRanks() override {
    std::vector<int> out;
    Call([&] {
      if (pybind11::hasattr(client_, "lost_ranks")) {
        out = client_.attr("lost_ranks")().cast<std::vector<int>>();
      }
    });
    return out;
  }

 protected:
  // One request (the client's set_and_get_many: SETMGET) where the client has it.
  std::vector<std::string> SetAndMultiGetRequest(const std::string& key, const std::string& value,
                                                 const std::vector<std::string>& keys,
                                                 double timeout_s, bool fail_on_lost) override {
    if (!Has("set_and_get_many")) {
      return Store::SetAndMultiGetRequest(key, value, keys, timeout_s, fail_on_lost);
    }
    std::vector<std::string> out;
    Call([&] {
      out = client_
                .attr("set_and_get_many")(key, pybind11::bytes(value), keys, timeout_s,
                                          pybind11::arg("watch_lost") = fail_on_lost)
                .cast<std::vector<std::string>>();
    });
    return out;
  }

 private:
  // Whether the client has this method (an optional request).
  bool Has(const char* method) {
    pybind11::gil_scoped_acquire gil;
    return pybind11::hasattr(client_, method);
  }

  template <typename F>
  void Call(F&& f) {
    pybind11::gil_scoped_acquire gil;
    try {
      f();
    } catch (pybind11::error_already_set& e) {
      const bool timeout = e.matches(PyExc_TimeoutError);
      std::string msg = std::string("rendezvous store: ") + e.what();
      if (timeout) throw StatusError(Status::Timeout(msg));
      // spark_hvd's PeerLostError (code 6) keeps its class and ranks across.
      pybind11::object value = e.value();
      if (pybind11::hasattr(value, "code") && pybind11::hasattr(value, "ranks") &&
          pybind11::int_(value.attr("code")).cast<int>() ==
              static_cast<int>(StatusCode::kPeerLost)) {
        std::vector<int32_t> ranks;
        try {
          ranks = value.attr("ranks").cast<std::vector<int32_t>>();
        } catch (const pybind11::cast_error&) {
        }
        throw StatusError(
            Status::PeerLost(pybind11::str(value).cast<std::string>(), std::move(ranks)));
      }
      throw StatusError(Status::StoreError(msg));
    }
  }
  pybind11::object client_;
};

}  // namespace spark_hvd
