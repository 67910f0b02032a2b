#include "server/http.hpp"

#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

#include "cascade/error.hpp"

// The header compiled against must be the version server/CMakeLists.txt checked (a tested one).
static_assert(std::string_view(CPPHTTPLIB_VERSION) == CASCADE_HTTPLIB_VERSION,
              "httplib.h is not the cpp-httplib version CMake found and checked (server/CMakeLists.txt)");

namespace cascade::server {

namespace {

// A fixed pool of threads with a bounded queue: enqueue() waits while the backlog is full, which holds the accept
// loop.
class BoundedPool {
 public:
  BoundedPool(int n_threads, int backlog) : backlog_(size_t(backlog)) {
    for (int i = 0; i < n_threads; ++i) threads_.emplace_back([this] { work(); });
  }
  ~BoundedPool() { shutdown(); }

  // Accepted connections waiting for a thread.
  size_t waiting() const { return waiting_.load(std::memory_order_relaxed); }

  void enqueue(std::function<void()> fn) {
    std::unique_lock lock(mu_);
    room_.wait(lock, [&] { return jobs_.size() < backlog_ || stop_; });
    jobs_.push_back(std::move(fn));
    waiting_.store(jobs_.size(), std::memory_order_relaxed);
    lock.unlock();
    ready_.notify_one();
  }

  // Serves what is queued, then joins the threads.
  void shutdown() {
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
        waiting_.store(jobs_.size(), std::memory_order_relaxed);
      }
      room_.notify_one();
      fn();
    }
  }

  size_t backlog_;
  std::atomic<size_t> waiting_{0};
  std::mutex mu_;
  std::condition_variable ready_, room_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

using Clock = std::chrono::steady_clock;

int ms_until(Clock::time_point t) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  return int(std::clamp<int64_t>(ms, 0, INT32_MAX));
}

// poll() on one socket for `events`, through signals; > 0 when ready, 0 at the timeout, < 0 on an error.
int wait_for(int sock, short events, int timeout_ms) {
  for (;;) {
    pollfd p{sock, events, 0};
    const int r = ::poll(&p, 1, timeout_ms);
    if (r >= 0 || errno != EINTR) return r;
  }
}

// One connection's bytes, for every request it carries. Like httplib's own stream (reads buffered, each read and
// write bounded by its timeout), plus a deadline for the request being read: read_timeout bounds one wait for
// bytes, so without it a client sending a byte every few seconds would hold a thread for as long as it likes.
// Bytes read ahead stay buffered for the connection's next request (httplib's stream, made per request, drops
// them).
class ConnStream final : public httplib::Stream {
 public:
  ConnStream(int sock, int read_timeout_ms, int write_timeout_ms)
      : sock_(sock), read_timeout_ms_(read_timeout_ms), write_timeout_ms_(write_timeout_ms) {}

  // A request begins: its line, headers and body must all arrive before `deadline`.
  void begin_request(Clock::time_point deadline) {
    deadline_ = deadline;
    expired_ = refused_ = false;
  }
  bool expired() const { return expired_; }
  // The request was answered without reading all of it (refused): the connection ends after the answer, or what
  // the client still sends would be read as requests.
  void refused() { refused_ = true; }
  bool ending() const { return expired_ || refused_; }
  bool buffered() const { return off_ < len_; }

  bool is_readable() const override {
    if (buffered()) return true;
    const int left = ms_until(deadline_);
    if (wait_for(sock_, POLLIN, std::min(read_timeout_ms_, left)) > 0) return true;
    if (ms_until(deadline_) == 0) expired_ = true;
    return false;
  }
  bool is_writable() const override { return wait_for(sock_, POLLOUT, write_timeout_ms_) > 0 && alive(); }

  ssize_t read(char* ptr, size_t size) override {
    if (!buffered()) {
      if (!is_readable()) return -1;
      if (size >= sizeof buf_) return recv_some(ptr, size);
      const ssize_t n = recv_some(buf_, sizeof buf_);
      if (n <= 0) return n;
      off_ = 0;
      len_ = size_t(n);
    }
    const size_t n = std::min(size, len_ - off_);
    std::memcpy(ptr, buf_ + off_, n);
    off_ += n;
    return ssize_t(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    for (;;) {
      const ssize_t n = ::send(sock_, ptr, size, MSG_NOSIGNAL);
      if (n >= 0 || errno != EINTR) return n;
    }
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return sock_; }
  // The client has closed its side or reset the connection (a request it pipelined still counts as present).
  bool client_left() const { return !alive(); }

 private:
  ssize_t recv_some(char* ptr, size_t size) const {
    for (;;) {
      const ssize_t n = ::recv(sock_, ptr, size, 0);
      if (n >= 0 || errno != EINTR) return n;
    }
  }
  // The client is still there: nothing to read, or something (not the end of the stream) to read.
  bool alive() const {
    if (buffered() || wait_for(sock_, POLLIN, 0) == 0) return true;
    char c;
    return ::recv(sock_, &c, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
  }
  void address(bool peer, std::string& ip, int& port) const {
    sockaddr_storage a{};
    socklen_t n = sizeof a;
    const int r = peer ? ::getpeername(sock_, reinterpret_cast<sockaddr*>(&a), &n)
                       : ::getsockname(sock_, reinterpret_cast<sockaddr*>(&a), &n);
    char host[NI_MAXHOST], serv[NI_MAXSERV];
    if (r != 0 || ::getnameinfo(reinterpret_cast<sockaddr*>(&a), n, host, sizeof host, serv, sizeof serv,
                                NI_NUMERICHOST | NI_NUMERICSERV) != 0)
      return;
    ip = host;
    port = std::atoi(serv);
  }

  int sock_, read_timeout_ms_, write_timeout_ms_;
  Clock::time_point deadline_ = Clock::time_point::max();
  mutable bool expired_ = false;
  bool refused_ = false;
  char buf_[4096];
  size_t off_ = 0, len_ = 0;
};

constexpr const char* kTooSlow = "the request did not arrive within the server's request timeout";

// The connection being served on this thread: the body's reader asks it whether the request ran out of time.
thread_local ConnStream* t_conn = nullptr;

// httplib's server, used for what it does with one request on a stream: parse it, route it to the handlers and
// write the answer (process_request). The listener's loop, the pool and each connection's loop are ours, so that
// timeouts and keep-alive are HttpConfig's whatever the library's defaults. What is used of httplib beyond its
// public interface is its interface for subclasses (protected): process_request, and svr_sock_, the socket
// bind_to_port makes, which its streamed answers watch (they stop once it is INVALID_SOCKET). That interface is
// not promised to stay, so server/CMakeLists.txt accepts only the versions this was tested with.
class Server final : public httplib::Server {
 public:
  explicit Server(const HttpConfig& c)
      : read_timeout_ms_(c.read_timeout_s * 1000), write_timeout_ms_(c.write_timeout_s * 1000),
        request_timeout_(c.request_timeout_s), keep_alive_(c.keep_alive_s) {}
  ~Server() override { close_listener(); }

  // httplib listens with a queue of 5 connections: more clients than that connecting at once, while the accept
  // loop waits for its turn on a core, had their handshakes dropped, and retried them only a second later.
  // listen() again on the bound socket sets the kernel's queue to n.
  bool set_listen_queue(int n) {
    listener_ = svr_sock_;
    return ::listen(listener_, n) == 0;
  }

  // Accepts connections (bound before) and serves each on the pool, until stop(). Returns once every accepted
  // connection has ended; false when the listener failed.
  bool accept_loop(BoundedPool& pool);
  // Ends accept_loop, idle connections and streamed answers (at their next write).
  void stop() {
    stopping_ = true;
    const socket_t s = svr_sock_.exchange(INVALID_SOCKET);
    if (s != INVALID_SOCKET) ::shutdown(s, SHUT_RDWR);
  }

 private:
  void serve(int sock, const BoundedPool& pool);
  bool next_request(const ConnStream& conn, const BoundedPool& pool) const;
  static void linger(int sock);
  void close_listener() {
    if (listener_ >= 0) ::close(listener_);
    listener_ = -1;
  }

  static constexpr auto kIdleWhenBusy = std::chrono::milliseconds(100);
  static constexpr size_t kMaxRequests = 1000;  // per connection
  const int read_timeout_ms_, write_timeout_ms_;
  const std::chrono::seconds request_timeout_, keep_alive_;
  int listener_ = -1;  // the bound socket, closed once the accept loop ends
  std::atomic<bool> stopping_{false};
};

bool Server::accept_loop(BoundedPool& pool) {
  bool ok = listener_ >= 0;
  while (ok && !stopping_) {
    if (wait_for(listener_, POLLIN, 100) <= 0) continue;
    const int sock = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (sock < 0) {
      // Out of descriptors: the connections being served close in time. Other errors end the listener (those of a
      // connection that went before it was accepted, and the shutdown of stop(), aside).
      if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      else ok = stopping_ || errno == EINTR || errno == EAGAIN || errno == ECONNABORTED || errno == EPROTO;
      continue;
    }
    // A write to a client that reads nothing (its socket buffer full) waits at most the write timeout.
    const timeval tv{write_timeout_ms_ / 1000, 0};
    ::setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    pool.enqueue([this, sock, &pool] { serve(sock, pool); });
  }
  stop();  // (when the listener failed) idle connections end too
  pool.shutdown();
  close_listener();
  return ok;
}

// One connection's requests, each with request_timeout to arrive, until it closes, idles out or breaks a rule.
void Server::serve(int sock, const BoundedPool& pool) {
  ConnStream conn(sock, read_timeout_ms_, write_timeout_ms_);
  t_conn = &conn;
  for (size_t left = kMaxRequests; left > 0 && next_request(conn, pool); --left) {
    conn.begin_request(Clock::now() + request_timeout_);
    bool closed = false;
    const bool ok = process_request(conn, left == 1, closed, nullptr);
    // A request out of time (answered 408, or not at all) or refused ends the connection: the rest of its bytes
    // would be read as new requests (a trickle with a new deadline each).
    if (!ok || closed || conn.ending()) break;
  }
  t_conn = nullptr;
  if (conn.ending()) linger(sock);
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
}

// Closing a socket with unread bytes resets the connection, and a reset can discard the answer still on its way
// to the client: so the server's side is shut first (the client sees the answer, then the end) and what the
// client sent meanwhile is read and dropped, for a second at most.
void Server::linger(int sock) {
  ::shutdown(sock, SHUT_WR);
  const auto end = Clock::now() + std::chrono::seconds(1);
  char sink[4096];
  for (size_t dropped = 0; dropped < (size_t(1) << 20) && wait_for(sock, POLLIN, ms_until(end)) > 0;) {
    const ssize_t n = ::recv(sock, sink, sizeof sink, 0);
    if (n <= 0) break;
    dropped += size_t(n);
  }
}

// Waits for a request's first bytes, up to the keep-alive timeout; false when the connection is idle that long,
// is closed, or the server stops. While other connections wait for a thread, an idle one keeps its thread for
// kIdleWhenBusy only: otherwise each idle connection ahead of a client would delay it by the whole idle timeout.
bool Server::next_request(const ConnStream& conn, const BoundedPool& pool) const {
  if (conn.buffered()) return true;
  const auto start = Clock::now();
  const auto idle_end = start + keep_alive_;
  while (!stopping_) {
    const int left = ms_until(idle_end);
    const int r = wait_for(conn.socket(), POLLIN, std::min(left, 50));
    if (r != 0) return r > 0;
    if (left == 0) return false;
    if (pool.waiting() > 0 && Clock::now() - start >= kIdleWhenBusy) return false;
  }
  return false;
}

}  // namespace

struct HttpServer::Impl {
  Api& api;
  HttpConfig cfg;
  Server svr;
  Impl(Api& a, HttpConfig c) : api(a), cfg(std::move(c)), svr(cfg) {}
  void route();
  void answer_errors();
  void read_body(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& read);
  void serve(const httplib::Request& req, const std::string& body, httplib::Response& res);
  void refuse(httplib::Response& res, int status, const char* what);
};

// An answer made here, before the API sees the request, with `Connection: close`: the rest of the request (if any)
// was not read, and the connection ends after the answer.
void HttpServer::Impl::refuse(httplib::Response& res, int status, const char* what) {
  if (t_conn) t_conn->refused();
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
    // A client that leaves while its answer is made cancels it, as a stream's does at its next write.
    int status = 500;
    std::string body;
    ConnStream* conn = t_conn;
    gen->finish(status, body, [conn] { return conn && conn->client_left(); });
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

// Bodies are read here, bounded by max_body as they arrive (decompressed, when a Content-Encoding is given):
// httplib checks its payload limit against Content-Length only, so a chunked or compressed body would otherwise be
// read whole, however large.
void HttpServer::Impl::read_body(const httplib::Request& req, httplib::Response& res,
                                 const httplib::ContentReader& read) {
  std::string body;
  bool too_large = false;
  const bool ok = read([&](const char* data, size_t n) {
    if (n > cfg.max_body - body.size()) {
      too_large = true;
      return false;
    }
    body.append(data, n);
    return true;
  });
  if (too_large || (!ok && res.status == 413)) return refuse(res, 413, "the request body is too large");
  if (!ok && t_conn && t_conn->expired()) return refuse(res, 408, kTooSlow);
  if (!ok) return refuse(res, 400, "the request body could not be read");
  serve(req, body, res);
}

// Every path of every method goes to the API.
void HttpServer::Impl::route() {
  const auto with_body = [this](const httplib::Request& req, httplib::Response& res,
                                const httplib::ContentReader& read) { read_body(req, res, read); };
  const auto without_body = [this](const httplib::Request& req, httplib::Response& res) { serve(req, req.body, res); };
  // Methods httplib reads a body for without a content reader (GET, OPTIONS): a chunked or compressed body is
  // refused before it is read; one with a Content-Length is bounded by httplib's payload limit.
  svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    const bool takes_body = req.method == "POST" || req.method == "PUT" || req.method == "PATCH" ||
                            req.method == "DELETE";
    if (!takes_body && (req.has_header("Transfer-Encoding") || req.has_header("Content-Encoding"))) {
      refuse(res, 400, "this method takes no chunked or compressed body");
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
}

// Answers httplib makes itself (413, 400 for a request it cannot parse) and exceptions: OpenAI error objects.
void HttpServer::Impl::answer_errors() {
  const httplib::Server::HandlerWithResponse on_error = [this](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    const int status = t_conn && t_conn->expired() ? 408 : res.status;  // 408: headers that did not arrive in time
    refuse(res, status,
           status == 408   ? kTooSlow
           : status == 413 ? "the request body is too large"
                           : "the request could not be read");
    return httplib::Server::HandlerResponse::Handled;
  };
  svr.set_error_handler(on_error);
  svr.set_exception_handler([this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what += std::string(": ") + e.what();
    } catch (...) {
    }
    res.status = 500;
    api.count_status(500);
    res.set_content(error_json(500, what), "application/json");
  });
}

HttpServer::HttpServer(Api& api, HttpConfig config) {
  CASCADE_CHECK(config.n_threads >= 1 && config.backlog >= 1,
                "the HTTP server needs at least one thread and backlog slot");
  CASCADE_CHECK(config.read_timeout_s >= 1 && config.write_timeout_s >= 1 && config.request_timeout_s >= 1 &&
                    config.keep_alive_s >= 1,
                "the HTTP server's timeouts must be at least a second");
  std::signal(SIGPIPE, SIG_IGN);
  impl_ = std::make_unique<Impl>(api, std::move(config));
  impl_->svr.set_payload_max_length(impl_->cfg.max_body);
  impl_->route();
  impl_->answer_errors();
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
  CASCADE_CHECK(impl_->svr.set_listen_queue(std::max(c.backlog, 64)), "cannot listen on ", c.host, ":", port);
  return port;
}

void HttpServer::run() {
  BoundedPool pool(impl_->cfg.n_threads, impl_->cfg.backlog);
  impl_->svr.accept_loop(pool);
}

void HttpServer::stop() { impl_->svr.stop(); }

}  // namespace cascade::server
