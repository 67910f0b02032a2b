// A generated sequence's text as it grows token by token, and how much of it may be sent to the client yet.
//
// Stop strings end the text: it is cut before the first occurrence of any of them. The end of the text that
// could still turn into a stop string, and a UTF-8 character whose bytes have not all arrived (a token may end
// inside one), wait for the next token; take(true) gives out everything left.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace cascade::server {

class StopText {
 public:
  explicit StopText(std::vector<std::string> stop = {});

  // Appends a token's bytes. Returns true when a stop string appeared: the text now ends before it, and
  // later calls change nothing.
  bool append(std::string_view piece);
  // The text after what was taken before that is safe to send now; final: all of it.
  std::string take(bool final = false);

  const std::string& text() const { return text_; }
  size_t sent() const { return sent_; }  // bytes taken so far
  bool stopped() const { return stopped_; }

 private:
  size_t held_back() const;  // bytes at the end that must wait

  std::vector<std::string> stop_;
  std::string text_;
  size_t sent_ = 0;
  bool stopped_ = false;
};

}  // namespace cascade::server
