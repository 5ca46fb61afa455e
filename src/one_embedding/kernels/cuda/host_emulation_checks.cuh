// The stress mode's checks, part of host_emulation.cuh (included from it, never on its own):
// shared memory per block with checked elements, and guarded copies of the pointer arguments.
//
// Shared memory. tests/cuda_emulation.py compiles rewritten copies of the sources (which define
// ONE_EMBEDDING_EMULATION_REWRITTEN): `__shared__ TYPE NAME[A][B];` becomes
//   static oe_emulation::Array<oe_emulation::Array<TYPE, (B)>, (A)> NAME_oe_static;
//   auto& NAME = oe_emulation::shared(NAME_oe_static, "NAME");
// and an array member `TYPE NAME[A];` of a struct becomes oe_emulation::Array<TYPE, (A), struct
// oe_member_NAME> (the tag names it in messages). shared() returns the declaration's static in
// the default mode (blocks run one after the other, so that is the block's shared memory) and
// the block's place in its arena in the stress mode, where blocks interleave. Array's operator[]
// bounds-checks the index and, for an arithmetic element, returns a Ref through which every read
// and write is checked:
//  - a read of an element no thread of the block wrote fails (the arena starts as 0xFF bytes);
//  - two threads touching one element, one of them writing, with no barrier that orders them
//    fail, whatever the schedule. The model is racecheck's: __syncthreads orders every two
//    threads of the block, __syncwarp the lanes of one warp; shuffles and ballots exchange values
//    but order no memory. Each access is stamped with the block's __syncthreads count and the
//    warp's __syncwarp count; an element keeps its last write and the reads since.
// A kernel that takes the address of a shared element, or passes one to a template by value,
// does not compile after the rewrite: read it into a local first.
//
// Global memory. Each pointer argument runs on a copy in its own mapping, the copy's last byte
// against a PROT_NONE guard page; arguments that overlap (y = f(h) in place) share one mapping.
// An access past the end faults; on_fault turns a fault on a guard page into a launch failure
// naming the argument, the element, the access and the thread (and any other fault of a kernel
// thread, on a fiber stack's guard page or a wild address, into one naming the thread).
// The bytes before the copy, up to the leading guard page, hold a canary: a write there fails
// the launch after the fact (a read there returns garbage; further below is the guard page).
// Copies go back to the caller's arrays only after a launch that passed.
#pragma once

namespace oe_emulation {

// --- shared memory of one block (stress mode)

// One access to a shared element: by `thread`, after `barriers` __syncthreads of its block and
// `syncs` __syncwarp of its warp.
struct Access {
  int thread = -1;
  unsigned barriers = 0, syncs = 0;
};

// What the race and initialisation checks know of one element (keyed by its first byte).
struct Cell {
  unsigned generation = 0;  // the arena's generation when last reset; older = a fresh cell
  unsigned barriers = 0;    // the block's barrier count when `reads` was last cleared
  bool written = false;
  Access write;
  std::vector<Access> reads;  // unordered reads since the last write, one per thread
};

struct Site {
  const void* key;  // the declaration's static
  const char* name;
  size_t offset, bytes, element_bytes;
};

constexpr size_t SHARED_BYTES = 48 * 1024;  // static shared memory a kernel may declare

struct Arena {
  alignas(64) unsigned char bytes[SHARED_BYTES];
  size_t used = 0, high_water = 0;
  unsigned generation = 1;
  std::vector<Site> sites;
  std::vector<Cell> cells;

  Arena() { memset(bytes, 0xFF, sizeof bytes); }
};

// A block starts: its shared memory is garbage again and no element is written.
inline void reset_arena(Block& b) {
  if (b.arena == nullptr) b.arena = new Arena();
  Arena& a = *b.arena;
  memset(a.bytes, 0xFF, a.high_water);  // past high_water it is still 0xFF
  a.used = 0;
  a.sites.clear();
  ++a.generation;
}

// --- shared arrays (the rewrite's types)

struct ArrayType {
  const char* (*member)();  // the struct member's name, or nullptr
  long long extent;
  size_t element_bytes;
};

// The name in `struct oe_member_NAME`, read from the signature of this function's instance.
template <class Tag>
const char* member_name() {
  if (std::is_void<Tag>::value) return nullptr;
  static char name[64];
  if (name[0] == 0) {
    const char* found = strstr(__PRETTY_FUNCTION__, "oe_member_");
    if (found == nullptr) return "?";
    found += strlen("oe_member_");
    snprintf(name, sizeof name, "%.*s", (int)strcspn(found, "];"), found);
  }
  return name;
}

inline const Site* site_of(const Block& b, const void* p) {
  if (!b.arena) return nullptr;
  const unsigned char* c = (const unsigned char*)p;
  for (const Site& s : b.arena->sites) {
    const unsigned char* base = b.arena->bytes + s.offset;
    if (c >= base && c < base + s.bytes) return &s;
  }
  return nullptr;
}

// "partial[3][5]", "states[1].stamp[7]": element `index` of the array at `array`.
inline std::string describe_element(const void* array, const ArrayType* type, long long index) {
  const char* member = type->member ? type->member() : nullptr;
  std::string out;
  const Site* s = running ? site_of(*running->block, array) : nullptr;
  if (s != nullptr) {
    const size_t at = (size_t)((const unsigned char*)array - (running->block->arena->bytes + s->offset));
    out = s->name;
    const bool whole = at == 0 && (size_t)type->extent * type->element_bytes == s->bytes;
    if (!whole) out += "[" + std::to_string(at / s->element_bytes) + "]";
  }
  if (member != nullptr) out += (out.empty() ? "" : ".") + std::string(member);
  if (out.empty()) out = "array";
  return out + "[" + std::to_string(index) + "]";
}

[[noreturn]] inline void out_of_bounds(const void* array, const ArrayType* type, long long index) {
  abort_fiber("shared-memory index out of bounds: " + describe_thread(*running) + " indexes `" +
              describe_element(array, type, index) + "`, extent " + std::to_string(type->extent));
}

// True when `a` happens before the access `now` of the running fiber: the same thread, or a
// __syncthreads of the block between them, or a __syncwarp between two lanes of one warp.
inline bool ordered(const Access& a, const Access& now, const Block& b) {
  if (a.thread == now.thread || a.barriers != b.barriers) return true;
  return a.thread / 32 == now.thread / 32 && a.syncs != now.syncs;
}

inline std::string describe_other(const Block& b, int linear) {
  return describe_thread(b.fibers[(size_t)linear]);
}

// The checks of one read or write of a shared element at `p` (stress mode only).
inline void shared_access(const void* p, const void* array, const ArrayType* type,
                          long long index, bool write) {
  scheduling_point();
  Block& b = *running->block;
  Arena& arena = *b.arena;
  const unsigned char* c = (const unsigned char*)p;
  if (c < arena.bytes || c >= arena.bytes + arena.used) return;  // not this block's shared memory
  const size_t offset = (size_t)(c - arena.bytes);
  if (arena.cells.size() < arena.used) arena.cells.resize(arena.used);
  Cell& cell = arena.cells[offset];
  if (cell.generation != arena.generation) {
    cell = Cell();
    cell.generation = arena.generation;
  }
  if (cell.barriers != b.barriers) {  // a __syncthreads ordered every earlier read
    cell.reads.clear();
    cell.barriers = b.barriers;
  }
  const Access now{running->linear, b.barriers, warp().syncs};
  const auto race = [&](const char* mine, int other, const char* theirs) {
    const bool same_warp = other / 32 == now.thread / 32;
    abort_fiber(std::string("shared-memory race on `") + describe_element(array, type, index) +
                "`: " + describe_thread(*running) + " " + mine + " it after " +
                describe_other(b, other) + " " + theirs + " it, with no " +
                (same_warp ? "__syncwarp or __syncthreads" : "__syncthreads") +
                " between them (a missing barrier)");
  };
  if (!write) {
    if (!cell.written) {
      abort_fiber("read of uninitialised shared memory: " + describe_thread(*running) +
                  " reads `" + describe_element(array, type, index) +
                  "`, which no thread of the block wrote");
    }
    if (!ordered(cell.write, now, b)) race("reads", cell.write.thread, "wrote");
    for (Access& r : cell.reads) {
      if (r.thread == now.thread) {
        r = now;
        return;
      }
    }
    cell.reads.push_back(now);
    return;
  }
  if (cell.written && !ordered(cell.write, now, b)) race("writes", cell.write.thread, "wrote");
  for (const Access& r : cell.reads) {
    if (!ordered(r, now, b)) race("writes", r.thread, "read");
  }
  cell.written = true;
  cell.write = now;
  cell.reads.clear();
}

inline bool checking() { return stress && running != nullptr; }

// One element of a shared array of arithmetic type: reads and writes go through the checks.
template <class E>
class Ref {
  using V = typename std::remove_const<E>::type;
  E* p_;
  const void* array_;
  const ArrayType* type_;
  long long index_;

  void touch(bool write) const {
    if (checking()) shared_access(p_, array_, type_, index_, write);
  }

 public:
  Ref(E* p, const void* array, const ArrayType* type, long long index)
      : p_(p), array_(array), type_(type), index_(index) {}
  Ref(const Ref&) = default;

  operator V() const {
    touch(false);
    return *p_;
  }
  Ref& operator=(V v) {
    touch(true);
    *p_ = v;
    return *this;
  }
  Ref& operator=(const Ref& other) { return *this = (V)other; }
  template <class U> Ref& operator+=(U v) { return *this = V((V)*this + v); }
  template <class U> Ref& operator-=(U v) { return *this = V((V)*this - v); }
  template <class U> Ref& operator*=(U v) { return *this = V((V)*this * v); }
  template <class U> Ref& operator/=(U v) { return *this = V((V)*this / v); }
  template <class U> Ref& operator|=(U v) { return *this = V((V)*this | v); }
  template <class U> Ref& operator&=(U v) { return *this = V((V)*this & v); }
  template <class U> Ref& operator^=(U v) { return *this = V((V)*this ^ v); }
  Ref& operator++() { return *this += 1; }
  Ref& operator--() { return *this -= 1; }
  V operator++(int) {
    const V old = *this;
    *this = V(old + 1);
    return old;
  }
  V operator--(int) {
    const V old = *this;
    *this = V(old - 1);
    return old;
  }
};

// A shared array of N elements E (E an arithmetic type, a struct, or another Array). Laid out as
// E[N], so the arena and the default mode's static hold it as the GPU would.
template <class E, long long N, class Tag = void>
struct Array {
  static_assert(N > 0, "a shared array needs a positive extent");
  E data[N];
  static constexpr size_t element_bytes = sizeof(E);

  static const ArrayType* type() {
    static const ArrayType t{std::is_void<Tag>::value ? nullptr : &member_name<Tag>, N, sizeof(E)};
    return &t;
  }

  template <class I>
  decltype(auto) operator[](I i) {
    const long long k = (long long)i;
    if (checking() && (k < 0 || k >= N)) out_of_bounds(this, type(), k);
    if constexpr (std::is_class<E>::value) {
      return (data[k]);
    } else {
      return Ref<E>(&data[k], this, type(), k);
    }
  }

  template <class I>
  decltype(auto) operator[](I i) const {
    const long long k = (long long)i;
    if (checking() && (k < 0 || k >= N)) out_of_bounds(this, type(), k);
    if constexpr (std::is_class<E>::value) {
      return (data[k]);
    } else {
      return Ref<const E>(&data[k], this, type(), k);
    }
  }
};

// The storage of one `__shared__` declaration for the running block: the declaration's own
// static in the default mode (blocks run one after the other), a place in the block's arena in
// the stress mode (blocks interleave), 0xFF bytes until written.
template <class T>
T& shared(T& declared, const char* name) {
  static_assert(std::is_trivially_default_constructible<T>::value, "shared storage is raw bytes");
  if (!checking()) return declared;
  Block& b = *running->block;
  Arena& arena = *b.arena;
  for (const Site& s : arena.sites) {
    if (s.key == &declared) return *reinterpret_cast<T*>(arena.bytes + s.offset);
  }
  const size_t offset = (arena.used + 15) & ~(size_t)15;
  if (offset + sizeof(T) > SHARED_BYTES) {
    abort_fiber("the kernel declares more than 48 KiB of shared memory (`" + std::string(name) +
                "` needs " + std::to_string(sizeof(T)) + " bytes at offset " +
                std::to_string(offset) + ")");
  }
  arena.sites.push_back(Site{&declared, name, offset, sizeof(T), T::element_bytes});
  arena.used = offset + sizeof(T);
  arena.high_water = std::max(arena.high_water, arena.used);
  return *reinterpret_cast<T*>(arena.bytes + offset);
}

// --- guarded copies of the pointer arguments (stress mode)

struct Region {
  char* mapping = nullptr;  // leading guard page | data pages | trailing guard page
  size_t mapping_bytes = 0;
  char* data = nullptr;     // the copy; ends at the trailing guard page
  size_t bytes = 0;
  char* original = nullptr;
  size_t itemsize = 1;
  std::string names;        // "`out` (T* out)" or several, for aliased arguments
  unsigned char canary = 0;
};

static std::vector<Region> regions;

struct Fault {
  bool pending = false;
  Fiber* fiber = nullptr;
  char* address = nullptr;
  int write = -1;  // 1 write, 0 read, -1 unknown
};

static Fault fault;

inline const Region* region_of(const char* address) {
  for (const Region& r : regions) {
    if (address >= r.mapping && address < r.mapping + r.mapping_bytes) return &r;
  }
  return nullptr;
}

inline bool on_stack_guard(const char* address) {
  for (const Stack& s : stacks) {
    if (address >= s.guard && address < s.base) return true;
  }
  return false;
}

static struct sigaction previous_segv, previous_bus;

static void on_fault(int signal, siginfo_t* info, void* context) {
  char* address = (char*)info->si_addr;
  if (running != nullptr) {  // a kernel thread faulted (the emulator's own code runs outside)
    fault.pending = true;
    fault.fiber = running;
    fault.address = address;
#if defined(__x86_64__) && defined(REG_ERR)
    fault.write = (((ucontext_t*)context)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#else
    (void)context;
#endif
    running->state = State::done;
    failed = true;
    setcontext(&scheduler);  // restores the scheduler's signal mask: SIGSEGV unblocked again
  }
  // not a kernel's: the handler that was there before gets the re-executed fault
  sigaction(signal, signal == SIGSEGV ? &previous_segv : &previous_bus, nullptr);
}

inline std::string describe_fault(const Fiber& f) {
  const char* access = fault.write == 1 ? "write" : (fault.write == 0 ? "read" : "access");
  const char* verb = fault.write == 1 ? "writes" : (fault.write == 0 ? "reads" : "accesses");
  const Region* r = region_of(fault.address);
  if (r == nullptr && on_stack_guard(fault.address)) {
    return "stack overflow (fiber stacks are " + std::to_string(STACK_BYTES / 1024) + " KiB): " +
           describe_thread(f);
  }
  if (r == nullptr) {
    char address[32];
    snprintf(address, sizeof address, "%p", (void*)fault.address);
    return "invalid global " + std::string(access) + ": " + describe_thread(f) + " " + verb +
           " address " + address + ", in no argument nor next to one";
  }
  const long long byte = (long long)(fault.address - r->data);
  const long long n = (long long)(r->bytes / r->itemsize);
  const long long element = byte >= 0 ? byte / (long long)r->itemsize
                                       : -((-byte + (long long)r->itemsize - 1) / (long long)r->itemsize);
  return "out-of-bounds global " + std::string(access) + ": " + describe_thread(f) + " " + verb +
         " element " + std::to_string(element) + " (byte offset " + std::to_string(byte) +
         ") of argument " + r->names + ", which has " + std::to_string(n) + " elements";
}

// Copies each array argument into a guarded mapping; `values` receives the new pointers.
// Returns false with `failure` set when a mapping cannot be made.
inline bool guard_arguments(void** args, int n_args, const long long* arg_bytes,
                            const int* arg_itemsize, const char* const* arg_names,
                            std::vector<void*>& values, std::vector<void*>& new_args) {
  struct Span {
    char* begin;
    char* end;
    int arg;
  };
  std::vector<Span> spans;
  values.assign((size_t)n_args, nullptr);
  new_args.assign(args, args + n_args);
  for (int i = 0; i < n_args; ++i) {
    if (arg_bytes[i] < 0) continue;  // a scalar
    char* p = *static_cast<char**>(args[i]);
    spans.push_back(Span{p, p + arg_bytes[i], i});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end > b.end);
  });
  const unsigned char canary = next_random() % 2 ? 0xFF : 0xA5;
  for (size_t s = 0; s < spans.size();) {
    // one region per group of overlapping arguments (empty arrays overlap nothing)
    char* begin = spans[s].begin;
    char* end = spans[s].end;
    size_t stop = s + 1;
    while (stop < spans.size() && spans[stop].begin < end && end > begin) {
      end = std::max(end, spans[stop].end);
      ++stop;
    }
    Region r;
    r.bytes = (size_t)(end - begin);
    r.original = begin;
    r.canary = canary;
    size_t align = 1;
    for (size_t k = s; k < stop; ++k) {
      const int a = spans[k].arg;
      align = std::max(align, (size_t)arg_itemsize[a]);
      if (r.names.empty()) {
        r.names = std::string("`") + arg_names[a] + "`";
      } else {
        r.names += std::string(" (overlapping `") + arg_names[a] + "`)";
      }
    }
    r.itemsize = (size_t)arg_itemsize[spans[s].arg];
    const size_t data_pages = (r.bytes + align + page() - 1) / page();
    r.mapping_bytes = (data_pages + 2) * page();
    void* m = mmap(nullptr, r.mapping_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
      fail("cannot map a guarded copy of argument " + r.names);
      return false;
    }
    r.mapping = (char*)m;
    mprotect(r.mapping, page(), PROT_NONE);
    mprotect(r.mapping + (data_pages + 1) * page(), page(), PROT_NONE);
    char* trailing = r.mapping + (data_pages + 1) * page();
    // the last byte against the trailing guard; the start stays aligned to the element size
    r.data = (char*)((uintptr_t)(trailing - r.bytes) & ~(uintptr_t)(align - 1));
    memset(r.mapping + page(), canary, (size_t)(r.data - (r.mapping + page())));
    memset(r.data + r.bytes, canary, (size_t)(trailing - (r.data + r.bytes)));
    memcpy(r.data, r.original, r.bytes);
    for (size_t k = s; k < stop; ++k) {
      const int a = spans[k].arg;
      values[(size_t)a] = r.data + (spans[k].begin - begin);
      new_args[(size_t)a] = &values[(size_t)a];
    }
    regions.push_back(r);
    s = stop;
  }
  return true;
}

// After a successful launch: a changed canary byte is a write outside its argument.
inline bool check_canaries() {
  for (const Region& r : regions) {
    char* first = r.mapping + page();
    char* trailing = r.mapping + r.mapping_bytes - page();
    for (char* c = first; c < trailing; ++c) {
      if (c == r.data) c += r.bytes;
      if (c >= trailing) break;
      if ((unsigned char)*c != r.canary) {
        const long long byte = (long long)(c - r.data);
        fail("out-of-bounds global write: some thread wrote byte offset " + std::to_string(byte) +
             " of argument " + r.names + " (" + std::to_string(r.bytes) + " bytes), " +
             (byte < 0 ? "before its start" : "past its end"));
        return false;
      }
    }
  }
  return true;
}

inline void release_regions(bool copy_back) {
  for (Region& r : regions) {
    if (copy_back) memcpy(r.original, r.data, r.bytes);
    munmap(r.mapping, r.mapping_bytes);
  }
  regions.clear();
}

}  // namespace oe_emulation
