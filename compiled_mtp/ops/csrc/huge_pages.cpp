// compiled_mtp::huge_page_bytes(nbytes) -> uint8 [nbytes] (huge_pages.h).
#include "huge_pages.h"

#include <c10/core/StorageImpl.h>
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

namespace compiled_mtp {
namespace {
constexpr int64_t PAGE = int64_t{2} << 20;  // a huge page
constexpr int64_t SLAB = 16 * PAGE;         // carved for many weights
constexpr int64_t ALIGN = 64;               // a cache line

std::mutex lock;
at::Tensor slab;   // the slab being carved; an earlier one lives on in the tensors carved from it
int64_t next = 0;  // its first free byte
int64_t end = 0;   // the end of its advised bytes

// A slab of at least `bytes` on whole huge pages, advised before its first touch: glibc maps a block
// above 32 MiB fresh, so no page of it is in place yet.
void new_slab(int64_t bytes) {
    const int64_t size = (bytes + PAGE - 1) / PAGE * PAGE;
    slab = at::empty({size + PAGE}, at::TensorOptions().dtype(at::kByte));
    const auto address = reinterpret_cast<uintptr_t>(slab.data_ptr());
    next = static_cast<int64_t>((PAGE - address % PAGE) % PAGE);
    end = next + size;
#ifdef MADV_HUGEPAGE
    static const bool advise = [] {
        const char* env = std::getenv("COMPILED_MTP_HUGE_PAGES");
        return env == nullptr || std::strcmp(env, "0") != 0;
    }();
    if (advise) madvise(reinterpret_cast<void*>(address + next), size, MADV_HUGEPAGE);  // refused: plain pages
#endif
}

// A moved storage's deleter: drops its piece of a slab.
void release(void* carved) { delete static_cast<at::Tensor*>(carved); }
}  // namespace

at::Tensor huge_page_bytes(int64_t nbytes) {
    TORCH_CHECK(nbytes >= 0, "huge_page_bytes: nbytes must be >= 0, got ", nbytes);
    const int64_t size = (nbytes + ALIGN - 1) / ALIGN * ALIGN;
    std::lock_guard<std::mutex> guard(lock);
    if (!slab.defined() || next + size > end) new_slab(std::max(size, SLAB));
    at::Tensor out = slab.narrow(0, next, nbytes);
    next += size;
    return out;
}

void move_to_huge_pages(const at::Tensor& t) {
    c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    const int64_t nbytes = static_cast<int64_t>(storage->nbytes());
    if (!t.device().is_cpu() || nbytes == 0 || storage->data_ptr().get_deleter() == &release) return;
    auto* carved = new at::Tensor(huge_page_bytes(nbytes));
    void* data = carved->data_ptr();
    std::memcpy(data, storage->data(), nbytes);
    storage->set_data_ptr_noswap(c10::DataPtr(data, carved, &release, t.device()));
}

TORCH_LIBRARY_FRAGMENT(compiled_mtp, m) {
    m.def("huge_page_bytes(int nbytes) -> Tensor", &huge_page_bytes);
    m.def("move_to_huge_pages(Tensor t) -> ()", &move_to_huge_pages);
}

}  // namespace compiled_mtp
