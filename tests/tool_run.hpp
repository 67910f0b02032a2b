// Running the build's tools as a user would, for the suites that test them: with stdout and stderr in
// files, or with stderr (and stdout, if asked) on a pseudo-terminal, as when a person watches. Every run is
// bounded in time.
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace tool_run {

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A fresh path under the build's tests folder, unique to this process and call.
inline std::string temp_path(const std::string& what) {
  static int n_calls = 0;
  return std::string(CASCADE_BINARY_DIR "/tests/") + what + "_" + std::to_string(getpid()) + "_" +
         std::to_string(n_calls++);
}

// The cache folder every tool run of the suites uses unless it says otherwise, so the suites never write
// into the user's own cache (XDG_CACHE_HOME; the tools keep auto's profile under it).
inline std::string suite_cache_home() { return CASCADE_BINARY_DIR "/tests/xdg-cache"; }

inline std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

struct Run {
  int rc = -1;
  std::string out, err;
};

// Runs `tool args` through the shell (args already shell-quoted), stdout and stderr in files, with
// `env` ("NAME=value ..." assignments, quoted) before it; XDG_CACHE_HOME is the suite's unless env sets it.
inline Run run(const std::string& tool, const std::string& args, const std::string& env = "") {
  const std::string out = temp_path("run_out"), err = temp_path("run_err");
  const std::string cmd = "XDG_CACHE_HOME=" + quote(suite_cache_home()) + " " + env + " timeout 600 " + tool + " " +
                          args + " >" + out + " 2>" + err + " </dev/null";
  const int st = std::system(cmd.c_str());
  Run r;
  r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  r.out = read_file(out);
  r.err = read_file(err);
  std::remove(out.c_str());
  std::remove(err.c_str());
  return r;
}

struct PtyRun {
  int rc = -1;
  bool timed_out = false;
  std::string tty;  // what the program wrote to the terminal, as written (no newline translation)
  std::string out;  // its stdout when that went to a file
};

// Runs argv[0] (a path) with stderr on a new pseudo-terminal of 120 columns, and stdout on it too when
// stdout_on_tty, else in a file; stdin is /dev/null; `env` entries ("NAME=value") are set for it, and
// XDG_CACHE_HOME is the suite's unless env sets it. Killed after timeout_s.
inline PtyRun run_in_pty(const std::vector<std::string>& argv, bool stdout_on_tty,
                         const std::vector<std::string>& env = {}, double timeout_s = 300) {
  PtyRun r;
  const int master = posix_openpt(O_RDWR | O_NOCTTY);
  REQUIRE_MESSAGE(master >= 0, "posix_openpt failed");
  REQUIRE(grantpt(master) == 0);
  REQUIRE(unlockpt(master) == 0);
  const std::string slave_name = ptsname(master);
  const int slave = open(slave_name.c_str(), O_RDWR | O_NOCTTY);
  REQUIRE_MESSAGE(slave >= 0, "cannot open " << slave_name);
  termios t{};
  REQUIRE(tcgetattr(slave, &t) == 0);
  t.c_oflag &= ~tcflag_t(OPOST);  // keep "\n" as written (no "\r\n"), so a "\r" is the program's own
  REQUIRE(tcsetattr(slave, TCSANOW, &t) == 0);
  winsize ws{};
  ws.ws_row = 40;
  ws.ws_col = 120;
  REQUIRE(ioctl(slave, TIOCSWINSZ, &ws) == 0);
  const std::string out_path = temp_path("pty_out");

  std::vector<std::string> full_env = {"XDG_CACHE_HOME=" + suite_cache_home()};
  full_env.insert(full_env.end(), env.begin(), env.end());
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    setsid();
    ioctl(slave, TIOCSCTTY, 0);
    const int null_in = open("/dev/null", O_RDONLY);
    const int out_fd = stdout_on_tty ? slave : open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (null_in < 0 || out_fd < 0) _exit(126);
    dup2(null_in, 0);
    dup2(out_fd, 1);
    dup2(slave, 2);
    close(master);
    for (const std::string& e : full_env) putenv(const_cast<char*>(e.c_str()));
    execv(args[0], args.data());
    _exit(127);
  }
  close(slave);

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  char buf[4096];
  for (;;) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      r.timed_out = true;
      break;
    }
    pollfd p{master, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = read(master, buf, sizeof buf);
    if (n <= 0) break;  // EIO: every copy of the terminal's other end is closed (the program ended)
    r.tty.append(buf, size_t(n));
  }
  int st = 0;
  waitpid(pid, &st, 0);
  close(master);
  r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  if (!stdout_on_tty) {
    r.out = read_file(out_path);
    std::remove(out_path.c_str());
  }
  return r;
}

}  // namespace tool_run
