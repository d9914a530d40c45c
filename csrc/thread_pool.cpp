#include "thread_pool.h"

#include <unistd.h>

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
  for (;;) {
    int64_t task;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (next_task_ >= num_tasks_) return;
      task = next_task_++;
    }
    try {
      (*fn_)(task);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      next_task_ = num_tasks_;
    }
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_tasks();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++num_finished_;
    }
    done_.notify_one();
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
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
    num_finished_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  run_tasks();
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return num_finished_ == workers_.size(); });
    fn_ = nullptr;
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
