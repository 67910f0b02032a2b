// The HTTP layer: moves requests to Api::handle and its replies back, streaming a generation's body as the engine
// produces it. A stream whose client has left (a write fails) cancels its request; so does a request answered whole
// whose client closes the connection while it waits (the socket is watched, Responder::finish). The listener, the
// threads and the connections are this layer's own; cpp-httplib reads each request and writes its answer (http.cpp).
//
// Connections are served by a fixed pool of threads with a bounded backlog: when every thread is busy and the
// backlog is full, the listener stops accepting until a thread frees up (the kernel's queue holds the rest), so
// threads and memory stay bounded under any number of connections. Keep the pool larger than the requests that
// may run and wait at once (-np plus the queue) so an idle connection cannot starve them. What one connection can
// hold: a thread while idle for keep_alive_s (0.1 s while others wait for a thread); a request's arrival,
// request_timeout_s from its first byte (then 408); a refused request ends its connection.
//
// The process ignores SIGPIPE once an HttpServer exists: a write to a client that left must fail, not kill it.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "server/api.hpp"

namespace cascade::server {

struct HttpConfig {
  std::string host = "127.0.0.1";
  int port = 8080;               // 0: any free port (bind() tells which)
  int n_threads = 32;            // connections served at once
  int backlog = 64;              // accepted connections waiting for a thread, at most
  size_t max_body = 4u << 20;    // bytes of a request body, at most (413 above)
  int read_timeout_s = 10;       // a wait for a request's next bytes ends after this (the request with it)
  int write_timeout_s = 5;       // a wait to write to a client that reads nothing ends after this (the answer with it)
  int request_timeout_s = 30;    // a whole request (line, headers, body) must arrive within this of its first byte
  int keep_alive_s = 5;          // an idle keep-alive connection is closed after this
};

class HttpServer {
 public:
  HttpServer(Api& api, HttpConfig config);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds the address; returns the port. Error when it cannot.
  int bind();
  // Serves until stop() (from another thread); returns once every connection's thread has finished.
  void run();
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cascade::server
