#include "backends/nccl/wait_marks.h"

#include <exception>

#include "common/logging.h"
#include "common/types.h"

namespace spark_hvd {
namespace nccl {

std::string WaitMarks::Key(const std::string& call, int member) const {
  return prefix + call + "/" + std::to_string(member);
}

void WaitMarks::Note(const std::string& call, const std::string& where) const {
  if (!store) return;
  try {
    store->Set(Key(call, self), "1");
  } catch (const std::exception& e) {
    SHVD_LOG(kWarning, "nccl") << where
                               << " could not note its wait in the rendezvous store: " << e.what();
  }
}

std::string WaitMarks::WhoIsMissing(const std::string& call, const std::string& all_waiting,
                                    std::vector<int32_t>* silent) const {
  silent->clear();
  if (!store) return "which peer is missing cannot be told here (no rendezvous store)";
  for (int m = 0; m < static_cast<int>(members.size()); ++m) {
    if (m == self) continue;
    try {
      store->Get(Key(call, m), 0.05);
    } catch (const std::exception&) {  // no key (or no answer): no sign of it
      silent->push_back(members[m]);
    }
  }
  if (silent->empty()) return all_waiting;
  return "rank(s) " + JoinRanks(*silent) +
         " never reached it (stuck before it, in their own "
         "work or on their GPU)";
}

}  // namespace nccl
}  // namespace spark_hvd
