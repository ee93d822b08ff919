// Memory for the weights every decode step reads whole, on 2 MiB pages where the system gives them.
// A step streams tens of MB of weights, and on 4 KiB pages each page costs the core a walk of the
// page tables: the shipped model decoded 3% fewer tokens a second, up to 13% (docs/passes.md).
#pragma once

#include "ops.h"

namespace compiled_mtp {

// `nbytes` of uninitialised memory, 64-byte aligned, carved from slabs that madvise(MADV_HUGEPAGE)
// marks before anything touches them (an advice: where the system gives none, plain pages). Many small
// weights share a slab, so that they too sit on large pages; a slab lives while any tensor carved
// from it does.
at::Tensor huge_page_bytes(int64_t nbytes);

// Moves the memory of `t`'s storage onto such slabs, in place: every tensor that shares the storage
// (a view, a tied weight) reads the same values from the new address. A storage moved before stays.
// Only for memory no compiled graph holds the address of yet.
void move_to_huge_pages(const at::Tensor& t);

}  // namespace compiled_mtp
