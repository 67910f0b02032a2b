// Chat formats; see chat.hpp.
#include "model/chat.hpp"

#include "cascade/error.hpp"
#include "model/utf8.hpp"

namespace cascade {

namespace {

constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";

bool contains(std::string_view t, std::string_view part) { return t.find(part) != std::string_view::npos; }

// What Python's str.isspace() accepts, which Jinja's trim filter strips.
bool is_python_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

// Jinja's `trim`: s without the Unicode whitespace at both ends (invalid UTF-8 is never whitespace).
std::string_view trim(std::string_view s) {
  size_t b = 0;
  while (b < s.size()) {
    const utf8::Decoded d = utf8::decode(s, b, /*strict=*/true);
    if (!d.len || !is_python_space(d.cp)) break;
    b += d.len;
  }
  size_t e = s.size();
  while (e > b) {
    size_t start = e - 1;  // back to the lead byte of the last character
    while (start > b && (uint8_t(s[start]) & 0xC0) == 0x80 && e - start < 4) --start;
    const utf8::Decoded d = utf8::decode(s, start, /*strict=*/true);
    if (d.len != e - start || !is_python_space(d.cp)) break;
    e = start;
  }
  return s.substr(b, e - b);
}

// Python's s.strip(c), s.lstrip(c), s.rstrip(c) for one character c.
std::string_view lstrip(std::string_view s, char c) {
  while (!s.empty() && s.front() == c) s.remove_prefix(1);
  return s;
}
std::string_view rstrip(std::string_view s, char c) {
  while (!s.empty() && s.back() == c) s.remove_suffix(1);
  return s;
}

// The variant details of a recognized template that change what is written.
struct ChatStyle {
  ChatFormat format = ChatFormat::chatml;
  std::string default_system;      // ChatML: written when the first message is not a system one
  bool thinking = false;           // ChatML: Qwen 3's reasoning blocks
  enum class Mistral { v1, v3, legacy } mistral = Mistral::v3;
  bool phi3_inline = false;        // Phi-3: the first template (assistant header after each user turn)
  bool phi3_skip_empty_system = false;
  bool phi3_eos_at_end = false;    // Phi-3: <|endoftext|> at the end without a generation prompt
};

ChatStyle detect_style(std::string_view t) {
  ChatStyle s;
  s.format = detect_chat_format(t);
  switch (s.format) {
    case ChatFormat::chatml:
      s.default_system = chatml_default_system(t);
      s.thinking = contains(t, "<think>");
      break;
    case ChatFormat::mistral:
      if (contains(t, "' [INST] '") || contains(t, "\" [INST] \"")) {
        s.mistral = ChatStyle::Mistral::v1;
      } else if (contains(t, "[AVAILABLE_TOOLS]")) {
        s.mistral = ChatStyle::Mistral::v3;
      } else {
        s.mistral = ChatStyle::Mistral::legacy;
      }
      break;
    case ChatFormat::phi3:
      s.phi3_inline = !contains(t, "<|system|>");
      s.phi3_skip_empty_system = contains(t, "'system' and message['content']");
      s.phi3_eos_at_end = contains(t, "eos_token");
      break;
    case ChatFormat::gemma:
    case ChatFormat::llama3:
      break;
  }
  return s;
}

void chatml_turn(std::string& out, std::string_view role, std::string_view content) {
  out += kImStart;
  out += role;
  out += '\n';
  out += content;
  out += kImEnd;
  out += '\n';
}

// Qwen 3: an assistant message as its template writes it (see chat.hpp); keep_reasoning for a message after
// the last user query.
void qwen3_assistant(std::string& out, std::string_view content, bool keep_reasoning, bool last) {
  std::string_view answer = content, reasoning;
  if (const size_t close = content.find("</think>"); close != std::string_view::npos) {
    answer = lstrip(content.substr(content.rfind("</think>") + 8), '\n');
    reasoning = rstrip(content.substr(0, close), '\n');
    if (const size_t open = reasoning.rfind("<think>"); open != std::string_view::npos) {
      reasoning = reasoning.substr(open + 7);
    }
    reasoning = lstrip(reasoning, '\n');
  }
  out += kImStart;
  out += "assistant\n";
  if (keep_reasoning && (last || !reasoning.empty())) {
    out += "<think>\n";
    out += rstrip(lstrip(reasoning, '\n'), '\n');
    out += "\n</think>\n\n";
    out += lstrip(answer, '\n');
  } else {
    out += answer;
  }
  out += kImEnd;
  out += '\n';
}

void write_chatml(std::string& out, const ChatStyle& s, const std::vector<ChatMessage>& msgs) {
  if (!msgs.empty() && msgs.front().role != "system" && !s.default_system.empty()) {
    chatml_turn(out, "system", s.default_system);
  }
  // Qwen 3: the last user message that is not a tool's response.
  size_t last_query = msgs.empty() ? 0 : msgs.size() - 1;
  for (size_t i = msgs.size(); i-- > 0;) {
    const std::string_view c = msgs[i].content;
    if (msgs[i].role == "user" && !(c.starts_with("<tool_response>") && c.ends_with("</tool_response>"))) {
      last_query = i;
      break;
    }
  }
  for (size_t i = 0; i < msgs.size(); ++i) {
    if (s.thinking && msgs[i].role == "assistant") {
      qwen3_assistant(out, msgs[i].content, i > last_query, i + 1 == msgs.size());
    } else {
      chatml_turn(out, msgs[i].role, msgs[i].content);
    }
  }
}

void write_llama3(std::string& out, const std::vector<ChatMessage>& msgs) {
  for (const ChatMessage& m : msgs) {
    out += "<|start_header_id|>";
    out += m.role;
    out += "<|end_header_id|>\n\n";
    out += trim(m.content);
    out += "<|eot_id|>";
  }
}

void write_phi3(std::string& out, const ChatStyle& s, const std::vector<ChatMessage>& msgs) {
  for (const ChatMessage& m : msgs) {
    const bool known = m.role == "system" || m.role == "user" || m.role == "assistant";
    if (!known || (m.role == "system" && (s.phi3_inline || (s.phi3_skip_empty_system && m.content.empty())))) {
      continue;
    }
    if (!s.phi3_inline || m.role == "user") {
      out += "<|";
      out += m.role;
      out += "|>\n";
    }
    out += m.content;
    out += "<|end|>\n";
    if (s.phi3_inline && m.role == "user") out += "<|assistant|>\n";
  }
}

void write_gemma(std::string& out, const std::vector<ChatMessage>& msgs) {
  const bool system = !msgs.empty() && msgs.front().role == "system";
  std::string prefix = system ? msgs.front().content + "\n\n" : "";
  for (size_t i = system ? 1 : 0; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    if (m.role != "user" && m.role != "assistant" && m.role != "system") continue;
    out += "<start_of_turn>";
    out += m.role == "assistant" ? "model" : m.role;
    out += '\n';
    out += prefix;
    prefix.clear();
    out += trim(m.content);
    out += "<end_of_turn>\n";
  }
}

void write_mistral(std::string& out, const ChatStyle& s, const std::vector<ChatMessage>& msgs) {
  using Mistral = ChatStyle::Mistral;
  const bool system = !msgs.empty() && msgs.front().role == "system";
  const size_t first = system ? 1 : 0;
  for (size_t i = first; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    if (m.role == "user") {
      out += s.mistral == Mistral::v1 ? " [INST] " : "[INST] ";
      // The system message's place: the first turn (v1, legacy) or the last message (v3).
      if (system && (s.mistral == Mistral::v3 ? i + 1 == msgs.size() : i == first)) {
        out += msgs.front().content;
        out += "\n\n";
      }
      out += m.content;
      out += s.mistral == Mistral::v3 ? "[/INST]" : " [/INST]";
    } else if (m.role == "assistant") {
      if (s.mistral != Mistral::legacy) out += ' ';
      out += s.mistral == Mistral::v3 ? trim(m.content) : std::string_view(m.content);
      out += "</s>";
    }
  }
}

}  // namespace

ChatFormat detect_chat_format(std::string_view t) {
  CASCADE_CHECK(!t.empty(),
                "chat: the model has no chat template (tokenizer.chat_template); pass a raw prompt without --chat "
                "instead");
  if (contains(t, kImStart)) return ChatFormat::chatml;
  if (contains(t, "[INST]")) {
    CASCADE_CHECK(!contains(t, "[SYSTEM_PROMPT]"), "chat: Mistral's v7 chat template ([SYSTEM_PROMPT]) is not "
                  "supported; pass a raw prompt without --chat instead");
    return ChatFormat::mistral;
  }
  if (contains(t, "<|assistant|>") && contains(t, "<|end|>")) return ChatFormat::phi3;
  if (contains(t, "<start_of_turn>")) return ChatFormat::gemma;
  if (contains(t, "<|start_header_id|>")) return ChatFormat::llama3;
  detail::fail("chat: unsupported chat template (recognized: ChatML, Llama 3, Mistral, Phi-3 and Gemma); pass a "
               "raw prompt without --chat instead");
}

std::string builtin_chat_template(std::string_view name) {
  if (name == "chatml") return std::string(kImStart);
  if (name == "llama3") return "<|start_header_id|>";
  if (name == "phi3") return "<|system|><|user|><|assistant|><|end|> eos_token";
  if (name == "gemma") return "<start_of_turn>";
  if (name == "mistral") return "[INST][AVAILABLE_TOOLS]";
  return {};
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
  const ChatStyle s = detect_style(template_text);
  std::string out;
  switch (s.format) {
    case ChatFormat::chatml:
      write_chatml(out, s, msgs);
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    case ChatFormat::llama3:
      write_llama3(out, msgs);
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case ChatFormat::phi3:
      write_phi3(out, s, msgs);
      if (!s.phi3_inline && add_generation_prompt) out += "<|assistant|>\n";
      if (!s.phi3_inline && !add_generation_prompt && s.phi3_eos_at_end) out += "<|endoftext|>";
      break;
    case ChatFormat::gemma:
      write_gemma(out, msgs);
      if (add_generation_prompt) out += "<start_of_turn>model\n";
      break;
    case ChatFormat::mistral:
      write_mistral(out, s, msgs);
      break;
  }
  return out;
}

}  // namespace cascade
