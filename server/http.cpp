#include "server/http.hpp"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "cascade/error.hpp"

namespace cascade::server {

namespace {

// httplib's task queue with a bound: enqueue() waits while the backlog is full, which holds the accept loop.
class BoundedPool final : public httplib::TaskQueue {
 public:
  BoundedPool(int n_threads, int backlog) : backlog_(size_t(backlog)) {
    for (int i = 0; i < n_threads; ++i) threads_.emplace_back([this] { work(); });
  }
  ~BoundedPool() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    std::unique_lock lock(mu_);
    room_.wait(lock, [&] { return jobs_.size() < backlog_ || stop_; });
    jobs_.push_back(std::move(fn));
    lock.unlock();
    ready_.notify_one();
  }

  void shutdown() override {
    {
      std::lock_guard lock(mu_);
      if (stop_ && threads_.empty()) return;
      stop_ = true;
    }
    ready_.notify_all();
    room_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

 private:
  void work() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock lock(mu_);
        ready_.wait(lock, [&] { return !jobs_.empty() || stop_; });
        if (jobs_.empty()) return;  // stopping, and every accepted connection was served
        fn = std::move(jobs_.front());
        jobs_.pop_front();
      }
      room_.notify_one();
      fn();
    }
  }

  size_t backlog_;
  std::mutex mu_;
  std::condition_variable ready_, room_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

}  // namespace

struct HttpServer::Impl {
  Api& api;
  HttpConfig cfg;
  httplib::Server svr;
  std::atomic<bool> in_run{false}, stopped{false};
  Impl(Api& a, HttpConfig c) : api(a), cfg(std::move(c)) {}
  void serve(const httplib::Request& req, const std::string& body, httplib::Response& res);
  void refuse(httplib::Response& res, int status, const char* what);
};

// An answer made here, before the API sees the request, with `Connection: close`: the rest of the body (if any) was
// not read. httplib 0.11 keeps the connection open on its side all the same; what the client still sends is read
// as requests, each refused with 400, until it closes or the idle timeout.
void HttpServer::Impl::refuse(httplib::Response& res, int status, const char* what) {
  api.count_status(status);
  res.status = status;
  res.set_header("Connection", "close");
  res.set_content(error_json(status, what), "application/json");
}

void HttpServer::Impl::serve(const httplib::Request& req, const std::string& body, httplib::Response& res) {
  Reply r = api.handle(req.method, req.path, req.get_header_value("Authorization"), body);
  for (const auto& [k, v] : r.headers) res.set_header(k, v);
  if (!r.pending) {
    res.status = r.status;
    res.set_content(r.body, r.content_type);
    return;
  }
  std::shared_ptr<Responder> gen = r.pending;
  if (!gen->streamed()) {
    int status = 500;
    std::string body;
    gen->finish(status, body);
    api.count_status(status);
    res.status = status;
    res.set_content(body, "application/json");
    return;
  }
  api.count_status(200);
  res.status = 200;
  res.set_chunked_content_provider(
      r.content_type,
      [gen](size_t, httplib::DataSink& sink) {
        std::string piece;
        const bool more = gen->next(piece, std::chrono::milliseconds(1000));
        if (!piece.empty() && !sink.write(piece.data(), piece.size())) {
          gen->cancel();  // the client left
          return false;
        }
        if (!more) sink.done();
        return true;
      },
      [gen](bool success) {
        if (!success) gen->cancel();
      });
}

HttpServer::HttpServer(Api& api, HttpConfig config) : impl_(std::make_unique<Impl>(api, std::move(config))) {
  std::signal(SIGPIPE, SIG_IGN);
  const HttpConfig& c = impl_->cfg;
  CASCADE_CHECK(c.n_threads >= 1 && c.backlog >= 1, "the HTTP server needs at least one thread and backlog slot");
  httplib::Server& svr = impl_->svr;
  const int n_threads = c.n_threads, backlog = c.backlog;
  svr.new_task_queue = [n_threads, backlog] { return new BoundedPool(n_threads, backlog); };
  svr.set_payload_max_length(c.max_body);
  svr.set_read_timeout(c.read_timeout_s, 0);
  svr.set_keep_alive_timeout(c.keep_alive_s);
  svr.set_keep_alive_max_count(1000);
  Impl* impl = impl_.get();
  // Bodies are read here, bounded by max_body as they arrive (decompressed, when a Content-Encoding is given):
  // httplib checks its payload limit against Content-Length only, so a chunked or compressed body would otherwise
  // be read whole, however large.
  const auto with_body = [impl](const httplib::Request& req, httplib::Response& res,
                                const httplib::ContentReader& read) {
    std::string body;
    bool too_large = false;
    const size_t max_body = impl->cfg.max_body;
    const bool ok = read([&](const char* data, size_t n) {
      if (n > max_body - body.size()) {
        too_large = true;
        return false;
      }
      body.append(data, n);
      return true;
    });
    if (too_large || (!ok && res.status == 413)) return impl->refuse(res, 413, "the request body is too large");
    if (!ok) return impl->refuse(res, 400, "the request body could not be read");
    impl->serve(req, body, res);
  };
  const auto without_body = [impl](const httplib::Request& req, httplib::Response& res) {
    impl->serve(req, req.body, res);
  };
  // Methods httplib reads a body for without a content reader (GET, OPTIONS): a chunked or compressed body is
  // refused before it is read; one with a Content-Length is bounded by httplib's payload limit.
  svr.set_pre_routing_handler([impl](const httplib::Request& req, httplib::Response& res) {
    const bool takes_body = req.method == "POST" || req.method == "PUT" || req.method == "PATCH" ||
                            req.method == "DELETE";
    if (!takes_body && (req.has_header("Transfer-Encoding") || req.has_header("Content-Encoding"))) {
      impl->refuse(res, 400, "this method takes no chunked or compressed body");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  svr.Get(".*", without_body);
  svr.Post(".*", with_body);
  svr.Put(".*", with_body);
  svr.Patch(".*", with_body);
  svr.Delete(".*", with_body);
  svr.Options(".*", without_body);
  // Answers httplib makes itself (413, 400 for a request it cannot parse): an OpenAI error object too.
  const httplib::Server::HandlerWithResponse on_error = [impl](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    impl->api.count_status(res.status);
    const char* what = res.status == 413 ? "the request body is too large" : "the request could not be read";
    res.set_content(error_json(res.status, what), "application/json");
    return httplib::Server::HandlerResponse::Handled;
  };
  svr.set_error_handler(on_error);
  svr.set_exception_handler([impl](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what += std::string(": ") + e.what();
    } catch (...) {
    }
    res.status = 500;
    impl->api.count_status(500);
    res.set_content(error_json(500, what), "application/json");
  });
}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind() {
  const HttpConfig& c = impl_->cfg;
  int port = c.port;
  if (port == 0) {
    port = impl_->svr.bind_to_any_port(c.host);
    CASCADE_CHECK(port > 0, "cannot listen on ", c.host, " (any port)");
  } else {
    CASCADE_CHECK(impl_->svr.bind_to_port(c.host, port), "cannot listen on ", c.host, ":", port,
                  " (in use, or not an address of this machine)");
  }
  return port;
}

void HttpServer::run() {
  impl_->in_run = true;
  if (!impl_->stopped) impl_->svr.listen_after_bind();
  impl_->in_run = false;
}

void HttpServer::stop() {
  impl_->stopped = true;
  // run() may be between its check and the listener's start: wait for the listener (a moment) to stop it.
  for (int i = 0; i < 1000 && impl_->in_run && !impl_->svr.is_running(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (impl_->svr.is_running()) impl_->svr.stop();
}

}  // namespace cascade::server
