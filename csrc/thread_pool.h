// A small persistent thread pool. std::thread rather than OpenMP so the kernels never fight
// torch's own OpenMP runtime for the same cores.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tokenlake {

// Runs one parallel_for at a time on num_threads threads: num_threads - 1 workers plus the
// calling thread. Concurrent callers are serialised.
class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(i) once for every i in [0, n), in any order, and returns when all calls have
  // finished. Indices are handed out dynamically, so uneven work items balance themselves.
  // Rethrows the first exception thrown by fn (remaining indices are then skipped). Returns as
  // soon as every started call has finished: a worker still asleep is not waited for.
  // spin_us > 0 (for jobs of microseconds, where waking a sleeping thread costs as much as
  // the job): the caller polls for the workers' last calls, and the workers poll for the next
  // job, for up to spin_us before they sleep; it burns that much CPU after each such job.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn, int64_t spin_us = 0);

 private:
  void worker_loop();
  void run_tasks();

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // held for a whole parallel_for
  std::mutex mutex_;       // guards everything below
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  int64_t next_task_ = 0;  // tasks handed out (an error lowers num_tasks_ to it)
  // Tasks finished: parallel_for returns once every task handed out has finished, without
  // waiting for workers that have not woken yet (they find nothing left and touch no job).
  int64_t num_done_ = 0;
  std::atomic<uint64_t> generation_{0};  // written under mutex_; polled without it
  int64_t spin_us_ = 0;                    // of the current job
  bool stop_ = false;
  std::exception_ptr error_;
};

// The process-wide pool: std::thread::hardware_concurrency() threads unless set_num_threads
// was called. A forked child (torch.multiprocessing) gets a fresh pool, since the parent's
// worker threads do not exist there.
std::shared_ptr<ThreadPool> default_pool();
void set_num_threads(int num_threads);
int get_num_threads();

}  // namespace tokenlake
