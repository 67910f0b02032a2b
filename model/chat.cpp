// Chat formats; see chat.hpp.
#include "model/chat.hpp"

#include "cascade/error.hpp"

namespace cascade {

namespace {

constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";

std::string_view trim(std::string_view s) {
  constexpr std::string_view ws = " \t\n\r\v\f";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

}  // namespace

ChatFormat detect_chat_format(std::string_view t) {
  CASCADE_CHECK(!t.empty(),
                "chat: the model has no chat template (tokenizer.chat_template); pass a raw prompt without --chat "
                "instead");
  if (t.find(kImStart) != std::string_view::npos) return ChatFormat::chatml;
  if (t.find("<|start_header_id|>") != std::string_view::npos) return ChatFormat::llama3;
  detail::fail("chat: unsupported chat template (recognized: ChatML and Llama 3); pass a raw prompt without "
               "--chat instead");
}

std::string chatml_default_system(std::string_view t) {
  // Look for a literal '<|im_start|>system\n...<|im_end|>' in the template: a newline written either as is
  // or as the two characters \n inside a Jinja string.
  const std::string_view head = "<|im_start|>system";
  for (size_t at = t.find(head); at != std::string_view::npos; at = t.find(head, at + 1)) {
    size_t p = at + head.size();
    if (t.substr(p, 1) == "\n") {
      p += 1;
    } else if (t.substr(p, 2) == "\\n") {
      p += 2;
    } else {
      continue;
    }
    const size_t end = t.find(kImEnd, p);
    if (end == std::string_view::npos) continue;
    const std::string_view text = t.substr(p, end - p);
    // Only a literal: quotes, braces or '+' mean the template builds the text from a message.
    if (text.empty() || text.find_first_of("'\"{}+") != std::string_view::npos) continue;
    std::string out;
    for (size_t k = 0; k < text.size(); ++k) {
      if (text[k] == '\\' && k + 1 < text.size() && text[k + 1] == 'n') {
        out += '\n';
        ++k;
      } else {
        out += text[k];
      }
    }
    return out;
  }
  return {};
}

std::string apply_chat_template(std::string_view template_text, const std::vector<ChatMessage>& msgs,
                                bool add_generation_prompt) {
  std::string out;
  switch (detect_chat_format(template_text)) {
    case ChatFormat::chatml: {
      const auto turn = [&](std::string_view role, std::string_view content) {
        out += kImStart;
        out += role;
        out += '\n';
        out += content;
        out += kImEnd;
        out += '\n';
      };
      if (!msgs.empty() && msgs.front().role != "system") {
        const std::string sys = chatml_default_system(template_text);
        if (!sys.empty()) turn("system", sys);
      }
      for (const ChatMessage& m : msgs) turn(m.role, m.content);
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    }
    case ChatFormat::llama3: {
      for (const ChatMessage& m : msgs) {
        out += "<|start_header_id|>";
        out += m.role;
        out += "<|end_header_id|>\n\n";
        out += trim(m.content);
        out += "<|eot_id|>";
      }
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    }
  }
  return out;
}

}  // namespace cascade
