#include "thread_pool.h"

#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>

namespace tokenlake {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads < 1) {
    throw std::invalid_argument("num_threads: expected >= 1, got " + std::to_string(num_threads));
  }
  workers_.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::run_tasks() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (next_task_ < num_tasks_) {
    const int64_t task = next_task_++;
    const std::function<void(int64_t)>* fn = fn_;
    lock.unlock();
    std::exception_ptr error;
    try {
      (*fn)(task);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    ++num_done_;
    if (error) {
      if (!error_) error_ = error;
      num_tasks_ = next_task_;  // hand out no more
    }
  }
  // the last task to finish (in whichever thread) lets the caller return
  if (num_done_ == next_task_) done_.notify_one();
}

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls done() for up to spin_us microseconds; whether it became true.
template <typename Done>
bool poll(int64_t spin_us, Done done) {
  if (spin_us <= 0) return false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  while (!done()) {
    for (int i = 0; i < 32; ++i) cpu_relax();
    if (std::chrono::steady_clock::now() >= until) return done();
  }
  return true;
}

}  // namespace

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  int64_t spin_us = 0;
  for (;;) {
    poll(spin_us, [&] { return generation_.load(std::memory_order_acquire) != seen; });
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_.load() != seen; });
      if (stop_) return;
      seen = generation_.load();
      spin_us = spin_us_;
    }
    run_tasks();
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t)>& fn,
                              int64_t spin_us) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fn_ = &fn;
    num_tasks_ = n;
    next_task_ = 0;
    num_done_ = 0;
    error_ = nullptr;
    spin_us_ = spin_us;
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();  // no system call when every worker is polling
  run_tasks();
  // Only the tasks a worker started are waited for: a worker that wakes late finds none left
  // and never reads fn_, so a descheduled worker does not hold up the caller.
  poll(spin_us, [&] {
    std::lock_guard<std::mutex> lock(mutex_);
    return num_done_ == next_task_;
  });
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return num_done_ == next_task_; });
    fn_ = nullptr;
    num_tasks_ = 0;
    next_task_ = 0;
    error = error_;
  }
  if (error) std::rethrow_exception(error);
}

namespace {

struct DefaultPool {
  std::mutex mutex;
  std::shared_ptr<ThreadPool> pool;
  pid_t owner = 0;
  int num_threads = 0;  // 0 = hardware_concurrency
};

DefaultPool& state() {
  static DefaultPool* s = new DefaultPool();  // never destroyed: workers may outlive statics
  return *s;
}

int resolve(int requested) {
  if (requested > 0) return requested;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// In-flight calls keep their own reference; the next call builds a new pool.
void drop(DefaultPool& s) {
  if (s.pool && s.owner != getpid()) {
    // Inherited across fork: its threads are gone and joining them would hang, so leak it.
    new std::shared_ptr<ThreadPool>(std::move(s.pool));
  }
  s.pool.reset();
}

}  // namespace

std::shared_ptr<ThreadPool> default_pool() {
  DefaultPool& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.pool && s.owner != getpid()) drop(s);
  if (!s.pool) {
    s.pool = std::make_shared<ThreadPool>(resolve(s.num_threads));
    s.owner = getpid();
  }
  return s.pool;
}

void set_num_threads(int num_threads) {
  if (num_threads < 1) {
    throw std::invalid_argument("num_threads: expected >= 1, got " + std::to_string(num_threads));
  }
  DefaultPool& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.num_threads = num_threads;
  if (s.pool && s.owner == getpid() && s.pool->num_threads() == num_threads) return;
  drop(s);
}

int get_num_threads() {
  DefaultPool& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return resolve(s.num_threads);
}

}  // namespace tokenlake
