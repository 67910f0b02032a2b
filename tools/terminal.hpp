// What cascade-generate shows a person watching a terminal: a progress line on stderr that updates in place
// (steps done of the total, tokens/s, K/V memory, elapsed and remaining time), and one sequence's text
// streamed to stdout as it is generated. The tool uses them only where the output is a terminal, so
// scripts reading a file or a pipe see what they always did.
#pragma once

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <string>

#include "model/generate.hpp"
#include "model/tokenizer.hpp"
#include "model/utf8.hpp"

namespace cascade::term {

inline bool is_terminal(FILE* f) { return isatty(fileno(f)) == 1; }

// The terminal's width in columns, 80 when it does not say.
inline int columns(FILE* f) {
  winsize ws{};
  if (ioctl(fileno(f), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 80;
}

// "0:42", "12:05", "1:02:03" (seconds rounded down; negative counts as 0).
inline std::string clock(double seconds) {
  const auto s = int64_t(std::max(0.0, seconds));
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  else
    std::snprintf(buf, sizeof buf, "%lld:%02lld", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  return buf;
}

// One state of a run's decode, as the progress line shows it.
struct ProgressState {
  int64_t steps_done = 0, steps_total = 0;  // decode steps; the total is the most there can be
  double tokens_per_s = 0;                  // decoded tokens over the decode steps' time
  double kv_bytes = 0;                      // K/V held now
  double elapsed_s = 0;                     // since the run started (prefill included)
  double remaining_s = -1;                  // estimate; < 0: not known yet
};

// "step 120/2319 | 168.3 tok/s | K/V 45.2 MiB | 0:42, ~2:31 left", cut to `width` characters (ASCII only,
// so a cut never splits a character).
inline std::string progress_text(const ProgressState& p, int width) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "step %lld/%lld | %.1f tok/s | K/V %.1f MiB | %s", static_cast<long long>(p.steps_done),
                static_cast<long long>(p.steps_total), p.tokens_per_s, p.kv_bytes / double(1 << 20),
                clock(p.elapsed_s).c_str());
  std::string s = buf;
  if (p.remaining_s >= 0) s += ", ~" + clock(p.remaining_s) + " left";
  if (width > 0 && int(s.size()) > width) s.resize(size_t(width));
  return s;
}

// The progress line on a terminal (stderr): redrawn in place at most every `min_interval_s` seconds, with
// permanent lines printed above it. Disabled, every call does nothing.
class Progress {
 public:
  using Clock = std::chrono::steady_clock;

  Progress(FILE* out, bool enabled, int64_t steps_total, double min_interval_s = 0.1)
      : out_(out), enabled_(enabled), min_interval_s_(min_interval_s), start_(Clock::now()) {
    state_.steps_total = steps_total;
  }
  ~Progress() { clear(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  bool enabled() const { return enabled_; }

  // A passing message ("calibrating ...", "prefill ..."), shown until the next draw.
  void status(const std::string& text) {
    if (!enabled_) return;
    shown_ = text;
    draw();
  }

  // After each decode step.
  void step(const StepStat& st) {
    if (!enabled_) return;
    ++state_.steps_done;
    decode_s_ += st.ms / 1e3;
    tokens_ += st.n_active;
    recent_.push_back(st.ms / 1e3);
    recent_sum_ += recent_.back();
    if (recent_.size() > kRecent) {
      recent_sum_ -= recent_.front();
      recent_.pop_front();
    }
    state_.tokens_per_s = decode_s_ > 0 ? double(tokens_) / decode_s_ : 0;
    state_.kv_bytes = double(st.kv_bytes);
    state_.remaining_s =
        double(std::max<int64_t>(0, state_.steps_total - state_.steps_done)) * recent_sum_ / double(recent_.size());
    const Clock::time_point now = Clock::now();
    if (drawn_ && std::chrono::duration<double>(now - last_draw_).count() < min_interval_s_ &&
        state_.steps_done < state_.steps_total)
      return;
    state_.elapsed_s = std::chrono::duration<double>(now - start_).count();
    shown_ = progress_text(state_, columns(out_) - 1);
    draw();
  }

  // A permanent line (with its newline), printed above the progress line.
  void print(const std::string& line) {
    if (!enabled_) {
      std::fputs(line.c_str(), out_);
      return;
    }
    erase();
    std::fputs(line.c_str(), out_);
    draw();
  }

  // Takes the line away for good (before the run's summary).
  void clear() {
    if (!enabled_) return;
    erase();
    shown_.clear();
  }

 private:
  static constexpr size_t kRecent = 16;  // steps the remaining time is estimated from

  void erase() {
    if (drawn_) std::fputs("\r\x1b[K", out_);
    drawn_ = false;
    std::fflush(out_);
  }
  void draw() {
    if (shown_.empty()) return;
    std::fputs("\r\x1b[K", out_);
    std::fputs(shown_.c_str(), out_);
    std::fflush(out_);
    drawn_ = true;
    last_draw_ = Clock::now();
  }

  FILE* out_;
  bool enabled_;
  double min_interval_s_;
  Clock::time_point start_, last_draw_;
  ProgressState state_;
  double decode_s_ = 0;
  int64_t tokens_ = 0;
  std::deque<double> recent_;
  double recent_sum_ = 0;
  std::string shown_;
  bool drawn_ = false;
};

// A sequence's text written to `out` as its tokens arrive, each write flushed; bytes of a character that the
// next token completes are held back until it does.
class TextStream {
 public:
  TextStream(const Tokenizer& tok, FILE* out) : tok_(tok), out_(out) {}

  void token(int32_t id) {
    pending_ += tok_.decode_next(id, state_, /*render_special=*/false);
    const size_t n = utf8::complete_prefix(pending_);
    write(pending_.substr(0, n));
    pending_.erase(0, n);
  }
  // What is still held back (a cut character at the very end), then a newline.
  void finish() {
    write(pending_ + "\n");
    pending_.clear();
  }

 private:
  void write(const std::string& s) {
    if (s.empty()) return;
    std::fwrite(s.data(), 1, s.size(), out_);
    std::fflush(out_);
  }

  const Tokenizer& tok_;
  FILE* out_;
  Tokenizer::DecodeState state_;
  std::string pending_;
};

}  // namespace cascade::term
