// The daemon's calls on gRPC's asynchronous API (Note [No callback API] in docs/architecture.md): kvd's completion
// queue and the fixed number of threads that drain it (CompletionThreads), and its server-streaming RPCs
// (kvd.v1.Kvd/Watch, grpc.health.v1.Health/Watch) as AsyncStreams — no thread per stream, no polling, and none of
// gRPC's callback threads.
//
// An AsyncStream is one call of one method: it asks gRPC for the call, opens or refuses it, writes its messages as
// they become ready (Pump, from any thread; one write in flight at a time), ends it with a status, and tells its
// method when gRPC is done with it (Closed). It owns itself from Listen until then; once its call came it listens for
// the next one (Successor). Its steps run on the completion threads, maybe two of one call at once (a cancel beside
// a write's end): every step takes mu_.
#pragma once

#include <grpcpp/completion_queue.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/async_stream.h>
#include <grpcpp/support/status.h>

#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#if defined(__SANITIZE_THREAD__)
#define KVD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVD_TSAN 1
#endif
#endif
#ifdef KVD_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace kvd::daemon {

// gRPC orders an operation's start before the step its completion runs, but inside libgrpc, which a TSan build
// cannot see (docs/reliability.md): kvd tells TSan itself. HandOff(tag) goes right before an operation with `tag`
// starts; the completion threads take it over before they run the tag's step. Nothing in other builds.
inline void HandOff([[maybe_unused]] void* tag) {
#ifdef KVD_TSAN
  __tsan_release(tag);
#endif
}

// kvd's completion queue, and the threads that run what completes on it (Note [No callback API] in
// docs/architecture.md): a fixed number, whatever the machine's CPUs.
class CompletionThreads {
 public:
  // What a completed operation runs, with gRPC's `ok`.
  class Step {
   public:
    virtual void Run(bool ok) = 0;

   protected:
    ~Step() = default;
  };

  // The queue is added to `builder`; Start after the server is built.
  CompletionThreads(grpc::ServerBuilder* builder, int threads) : cq_(builder->AddCompletionQueue()), count_(threads) {}
  ~CompletionThreads() { Stop(); }
  CompletionThreads(const CompletionThreads&) = delete;
  CompletionThreads& operator=(const CompletionThreads&) = delete;

  grpc::ServerCompletionQueue* cq() const { return cq_.get(); }
  void Start() {
    for (int i = 0; i < count_; ++i) threads_.emplace_back([cq = cq_.get()] { Drain(cq); });
  }
  // After grpc::Server::Shutdown (which ends every call) and once nothing else starts an operation on the queue:
  // every call is done and gone once this returns.
  void Stop() {
    if (stopped_) return;
    stopped_ = true;
    cq_->Shutdown();
    if (threads_.empty()) Drain(cq_.get());  // never started: gRPC requires the queue drained before it goes
    for (std::thread& t : threads_) t.join();
  }

 private:
  static void Drain(grpc::ServerCompletionQueue* cq) {
    void* tag = nullptr;
    bool ok = false;
    while (cq->Next(&tag, &ok)) {
#ifdef KVD_TSAN
      __tsan_acquire(tag);
#endif
      static_cast<Step*>(tag)->Run(ok);
    }
  }

  const std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  const int count_;
  std::vector<std::thread> threads_;
  bool stopped_ = false;
};

template <typename Request, typename Message>
class AsyncStream : public std::enable_shared_from_this<AsyncStream<Request, Message>> {
 public:
  using Writer = grpc::ServerAsyncWriter<Message>;
  // How a stream ends: its status, and the reason for the log.
  struct End {
    grpc::Status status;
    const char* reason;
  };

  virtual ~AsyncStream() = default;

  // Asks gRPC for the method's next call on `cq`; the stream owns itself from now on.
  void Listen(grpc::ServerCompletionQueue* cq) {
    absl::MutexLock lock(&mu_);
    cq_ = cq;
    self_ = this->shared_from_this();
    context_.AsyncNotifyWhenDone(&done_);
    HandOff(&done_);
    HandOff(&requested_);
    RequestCall(&context_, &request_, &writer_, cq, &requested_);
  }

  // A message may be ready: writes it unless one is in flight, or ends the stream if NextLocked says so. Any
  // thread; never blocks on gRPC. Nothing is written before the stream opened.
  void Pump() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    PumpLocked();
  }

 protected:
  AsyncStream() : writer_(&context_) {}

  // The service's Request<Method>(context, request, writer, cq, cq, tag).
  virtual void RequestCall(grpc::ServerContext* context, Request* request, Writer* writer,
                           grpc::ServerCompletionQueue* cq, void* tag) = 0;
  // A stream of the same method, to listen for the next call.
  virtual std::shared_ptr<AsyncStream> Successor() = 0;
  // The call came (request() and context() are its): OK opens the stream, anything else refuses it with that
  // status (and Closed never runs). On a completion thread, mu_ not held.
  virtual grpc::Status Open() = 0;
  // The next message, into `*message` (empty on entry) (true); or false, with `*end` set when the stream ends now.
  // Under mu_: it must not block (it may take leaf locks).
  virtual bool NextLocked(Message* message, End* end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  // Once, when gRPC is done with an opened stream, with the status it ended with. mu_ not held.
  virtual void Closed(const End& end) = 0;

  const Request& request() const { return request_; }
  const grpc::ServerContext& context() const { return context_; }

  absl::Mutex mu_;

 private:
  template <void (AsyncStream::*kFn)(bool)>
  class StepOf final : public CompletionThreads::Step {
   public:
    explicit StepOf(AsyncStream* stream) : stream_(stream) {}
    void Run(bool ok) override { (stream_->*kFn)(ok); }

   private:
    AsyncStream* const stream_;
  };

  void OnRequested(bool ok) {
    // Not ok: the server is shutting down and this call never started (gRPC then never returns done_).
    if (!ok) {
      std::shared_ptr<AsyncStream> self;
      absl::MutexLock lock(&mu_);
      self = std::move(self_);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      opening_ = true;
    }
    grpc::ServerCompletionQueue* cq;
    {
      absl::MutexLock lock(&mu_);
      cq = cq_;
    }
    Successor()->Listen(cq);
    grpc::Status opened = Open();
    std::shared_ptr<AsyncStream> closing;
    {
      absl::MutexLock lock(&mu_);
      opening_ = false;
      opened_ = opened.ok();
      if (!opened.ok()) {
        EndLocked(End{std::move(opened), "refused"});
      } else if (!ended_) {
        // Initial metadata now, not with the first message: a client that waits for it knows its stream is open.
        writing_ = true;
        HandOff(&sent_);
        writer_.SendInitialMetadata(&sent_);
      }
      // else: cancelled while it opened (OnDone ended it); opened_ lets Closed undo what Open did.
      closing = ClosingLocked();
    }
    if (closing != nullptr) Close();
  }

  void OnSent(bool ok) {
    std::shared_ptr<AsyncStream> closing;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      // A cancel that came while the write was in flight left the stream to this step, also when the write itself
      // got through (ok): nothing else would end it.
      if (!ok || cancelled_) {
        EndLocked(End{grpc::Status::CANCELLED, cancelled_ ? "the client closed the stream" : "the stream broke"});
      } else {
        PumpLocked();
      }
      closing = ClosingLocked();
    }
    if (closing != nullptr) Close();
  }

  void OnFinished(bool) {
    std::shared_ptr<AsyncStream> closing;
    {
      absl::MutexLock lock(&mu_);
      finished_ = true;
      closing = ClosingLocked();
    }
    if (closing != nullptr) Close();
  }

  // The call is over: finished by the stream, or cancelled (the client went, its deadline passed, the server is
  // shutting down).
  void OnDone(bool) {
    std::shared_ptr<AsyncStream> closing;
    {
      absl::MutexLock lock(&mu_);
      done_seen_ = true;
      if (!ended_) {
        cancelled_ = true;
        // A write in flight ends too, and its OnSent finishes the stream.
        if (!writing_) EndLocked(End{grpc::Status::CANCELLED, "the client closed the stream"});
      }
      closing = ClosingLocked();
    }
    if (closing != nullptr) Close();
  }

  void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!opened_ || ended_ || writing_) return;
    End end{grpc::Status::OK, nullptr};
    message_.Clear();  // gRPC holds what it still sends of the last one
    if (NextLocked(&message_, &end)) {
      writing_ = true;
      HandOff(&sent_);
      writer_.Write(message_, &sent_);
    } else if (end.reason != nullptr) {
      EndLocked(std::move(end));
    }
  }

  void EndLocked(End end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ended_) return;
    ended_ = true;
    end_ = std::move(end);
    HandOff(&finish_step_);
    writer_.Finish(end_.status, &finish_step_);
  }

  // The stream's own reference once nothing of gRPC's refers to it any more; null before.
  std::shared_ptr<AsyncStream> ClosingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (opening_ || !done_seen_ || !finished_ || writing_) return nullptr;
    return std::move(self_);
  }

  void Close() ABSL_LOCKS_EXCLUDED(mu_) {
    End end{grpc::Status::OK, ""};
    {
      absl::MutexLock lock(&mu_);
      if (!opened_) return;
      end = end_;
    }
    Closed(end);
  }

  grpc::ServerContext context_;
  Request request_;
  Writer writer_;
  grpc::ServerCompletionQueue* cq_ ABSL_GUARDED_BY(mu_) = nullptr;
  StepOf<&AsyncStream::OnRequested> requested_{this};
  StepOf<&AsyncStream::OnSent> sent_{this};
  StepOf<&AsyncStream::OnFinished> finish_step_{this};
  StepOf<&AsyncStream::OnDone> done_{this};
  std::shared_ptr<AsyncStream> self_ ABSL_GUARDED_BY(mu_);
  Message message_ ABSL_GUARDED_BY(mu_);       // the write in flight: gRPC reads it until OnSent
  bool opening_ ABSL_GUARDED_BY(mu_) = false;  // Open is running: the stream stays
  bool opened_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;  // Finish was called: no write ever again
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool done_seen_ ABSL_GUARDED_BY(mu_) = false;
  End end_ ABSL_GUARDED_BY(mu_){grpc::Status::OK, ""};
};

}  // namespace kvd::daemon
