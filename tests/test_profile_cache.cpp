// cpu/profile_cache.hpp: auto's profile kept per machine. A profile is written once, read back by later
// calls with the same key, measured anew when any part of the key changes, replaced atomically, and a
// cache that cannot be used (no folder, an unwritable one, a damaged file) never fails a call.
#include "cascade/cpu/profile_cache.hpp"

#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tool_run.hpp"

namespace test_profile_cache {

namespace fs = std::filesystem;
using cascade::CostModel;
using cascade::DType;
using cascade::HeadShape;
using cascade::cpu::CachedProfile;
using cascade::cpu::ProfileCacheOptions;
using cascade::cpu::ProfileKey;

namespace {

// A fresh, empty folder under the build's tests folder.
fs::path fresh_dir(const std::string& what) {
  static int n = 0;
  const fs::path d = fs::path(CASCADE_BINARY_DIR "/tests") / (what + "_" + std::to_string(getpid()) + "_" +
                                                               std::to_string(n++));
  fs::remove_all(d);
  return d;
}

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A profile with random rates (as a calibration would give), and a measure() that returns a new one
// each call and counts its calls.
CostModel random_model(std::mt19937& rng, int n_threads) {
  std::uniform_real_distribution<double> u(1.0, 100.0);
  CostModel m;
  m.n_threads = n_threads;
  m.n_kv_heads = 3;
  m.head_dim = 64;
  m.read_bw = u(rng) * 1e9;
  m.small_bw = u(rng) * 1e9;
  m.small_mac = u(rng) * 1e9;
  m.tiled_bw = u(rng) * 1e9;
  m.tiled_mac = u(rng) * 1e9;
  m.item_s = u(rng) * 1e-8;
  m.tiled_item_s = u(rng) * 1e-7;
  return m;
}

struct Measure {
  std::mt19937 rng{std::random_device{}()};
  int n_calls = 0;
  CostModel last;
  std::function<CostModel()> fn() {
    return [this] {
      ++n_calls;
      last = random_model(rng, 2);
      return last;
    };
  }
};

ProfileKey a_key() { return ProfileKey::here(2, HeadShape{9, 3, 64}, DType::f16); }

ProfileCacheOptions in(const fs::path& dir, bool recalibrate = false) {
  ProfileCacheOptions o;
  o.dir = dir;
  o.recalibrate = recalibrate;
  return o;
}

// The folder's file names (to see that no temporary file is left behind).
std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  return names;
}

// Sets an environment variable for one scope and puts the old value back after it.
class EnvVar {
 public:
  EnvVar(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    value ? setenv(name, value, 1) : unsetenv(name);
  }
  ~EnvVar() { old_ ? setenv(name_, old_->c_str(), 1) : unsetenv(name_); }
  EnvVar(const EnvVar&) = delete;
  EnvVar& operator=(const EnvVar&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace

TEST_CASE("profile cache: the first call measures and writes the profile, later calls read it back") {
  const fs::path dir = fresh_dir("cache_rw") / "nested" / "cascade";  // made on first write
  const ProfileKey key = a_key();
  Measure m;
  const CachedProfile first = cascade::cpu::cached_profile(key, in(dir), m.fn());
  CHECK(m.n_calls == 1);
  CHECK(first.source == CachedProfile::Source::calibrated);
  CHECK(first.note.empty());
  CHECK(first.path == dir / key.file_name());
  CHECK(first.model.to_string() == m.last.to_string());
  // The file: the header, the key in full, then the profile exactly.
  CHECK(read(first.path) == "cascade-profile 1\n" + key.text() + m.last.to_string());
  CHECK(names_in(dir) == std::vector<std::string>{key.file_name()});

  for (int rep = 0; rep < 3; ++rep) {
    const CachedProfile again = cascade::cpu::cached_profile(key, in(dir), m.fn());
    CHECK(m.n_calls == 1);  // not measured again
    CHECK(again.source == CachedProfile::Source::cache);
    CHECK(again.note.empty());
    CHECK(again.path == first.path);
    CHECK(again.calibrate_s == 0);
    CHECK(again.model.to_string() == first.model.to_string());
  }
  // --recalibrate: measured anew, and the new profile replaces the old one.
  const CachedProfile fresh = cascade::cpu::cached_profile(key, in(dir, /*recalibrate=*/true), m.fn());
  CHECK(m.n_calls == 2);
  CHECK(fresh.source == CachedProfile::Source::calibrated);
  CHECK(fresh.model.to_string() != first.model.to_string());
  CHECK(cascade::cpu::cached_profile(key, in(dir), m.fn()).model.to_string() == fresh.model.to_string());
  CHECK(m.n_calls == 2);
  CHECK(names_in(dir).size() == 1);
  fs::remove_all(dir.parent_path().parent_path());
}

TEST_CASE("profile cache: a change in any part of the key measures a new profile and keeps the old one") {
  const fs::path dir = fresh_dir("cache_key");
  const ProfileKey key = a_key();
  Measure m;
  const std::string kept = cascade::cpu::cached_profile(key, in(dir), m.fn()).model.to_string();
  struct Change {
    const char* what;
    std::function<void(ProfileKey&)> apply;
  };
  const std::vector<Change> changes = {
      {"cpu model", [](ProfileKey& k) { k.cpu_model += " v2"; }},
      {"cpu features", [](ProfileKey& k) { k.cpu_features += " x-extra"; }},  // differs from any CPU's list
      {"instruction set tier", [](ProfileKey& k) { k.isa = k.isa == "portable" ? "avx2" : "portable"; }},
      {"build", [](ProfileKey& k) { k.build = "clang 99, compiled for x86-64"; }},
      {"thread count", [](ProfileKey& k) { k.n_threads += 1; }},
      {"KV heads", [](ProfileKey& k) { k.n_kv_heads = 8; }},
      {"head dim", [](ProfileKey& k) { k.head_dim = 128; }},
      {"K/V type", [](ProfileKey& k) { k.kv_dtype = DType::f32; }},
      {"library version", [](ProfileKey& k) { k.version = "0.0.1"; }},
      {"kernel revision", [](ProfileKey& k) { k.kernels -= 1; }},
  };
  int expected_calls = 1;
  for (const Change& c : changes) {
    CAPTURE(c.what);
    ProfileKey other = key;
    c.apply(other);
    CHECK(other.text() != key.text());
    CHECK(other.file_name() != key.file_name());
    const CachedProfile p = cascade::cpu::cached_profile(other, in(dir), m.fn());
    CHECK(m.n_calls == ++expected_calls);
    CHECK(p.source == CachedProfile::Source::calibrated);
    CHECK(p.path == dir / other.file_name());
    // The first key's profile is still there, untouched.
    const CachedProfile old = cascade::cpu::cached_profile(key, in(dir), m.fn());
    CHECK(old.source == CachedProfile::Source::cache);
    CHECK(old.model.to_string() == kept);
    CHECK(m.n_calls == expected_calls);
  }
  CHECK(names_in(dir).size() == changes.size() + 1);

  // The key made here: the thread count is what calibration runs with (never 0, never above the machine).
  const int all = tbb::info::default_concurrency();
  CHECK(ProfileKey::here(0, HeadShape{9, 3, 64}, DType::f16).n_threads == all);
  CHECK(ProfileKey::here(100000, HeadShape{9, 3, 64}, DType::f16).n_threads == all);
  CHECK(ProfileKey::here(1, HeadShape{9, 3, 64}, DType::f16).n_threads == 1);
  // Only the KV heads and head dim of a shape matter (calibrate() measures without GQA).
  CHECK(ProfileKey::here(1, HeadShape{9, 3, 64}, DType::f16).text() ==
        ProfileKey::here(1, HeadShape{3, 3, 64}, DType::f16).text());
  CHECK(key.text().find("version " CASCADE_VERSION_STRING "\n") != std::string::npos);
  CHECK(key.text().find("kernels " + std::to_string(cascade::cpu::kKernelRevision) + "\n") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("profile cache: a damaged file or another key's file under the name is measured again, not used") {
  const fs::path dir = fresh_dir("cache_bad");
  const ProfileKey key = a_key();
  Measure m;
  const CachedProfile first = cascade::cpu::cached_profile(key, in(dir), m.fn());

  // Another key's profile under this key's name (a hash collision): replaced without a word.
  ProfileKey other = key;
  other.head_dim = 96;
  const std::string theirs = "cascade-profile 1\n" + other.text() + random_model(m.rng, 2).to_string();
  std::ofstream(first.path, std::ios::binary) << theirs;
  const CachedProfile p1 = cascade::cpu::cached_profile(key, in(dir), m.fn());
  CHECK(m.n_calls == 2);
  CHECK(p1.source == CachedProfile::Source::calibrated);
  CHECK(p1.note.empty());
  CHECK(read(first.path) == "cascade-profile 1\n" + key.text() + m.last.to_string());

  // Damaged files: measured again with a note naming the file, and rewritten whole.
  const std::string good = read(first.path);
  const std::vector<std::string> damaged = {
      "",
      "garbage\n",
      good.substr(0, good.size() / 2) + "read_bw banana\n",
      "cascade-profile 1\n" + key.text() + "cascade-cost-model 1\nread_bw -1\n",
      "cascade-profile 1\n" + key.text() + "cascade-cost-model 1\nmystery 3\n",
  };
  int calls = m.n_calls;
  for (const std::string& bytes : damaged) {
    CAPTURE(bytes);
    std::ofstream(first.path, std::ios::binary | std::ios::trunc) << bytes;
    const CachedProfile p = cascade::cpu::cached_profile(key, in(dir), m.fn());
    CHECK(m.n_calls == ++calls);
    CHECK(p.source == CachedProfile::Source::calibrated);
    if (bytes.rfind("cascade-profile 1\n" + key.text(), 0) == 0 || bytes.rfind("cascade-profile", 0) != 0) {
      CHECK(p.note.find("unusable") != std::string::npos);
      CHECK(p.note.find(first.path.string()) != std::string::npos);
    }
    CHECK(p.model.to_string() == m.last.to_string());
    CHECK(cascade::cpu::cached_profile(key, in(dir), m.fn()).source == CachedProfile::Source::cache);
    CHECK(m.n_calls == calls);
  }
  fs::remove_all(dir);
}

TEST_CASE("profile cache: no folder, or one that cannot be written, is a note and a profile, never an error") {
  const fs::path base = fresh_dir("cache_unwritable");
  fs::create_directories(base);
  std::ofstream(base / "a_file") << "not a folder\n";
  const ProfileKey key = a_key();
  Measure m;
  // A folder below a regular file cannot be made (whoever runs the test, root included).
  const fs::path dir = base / "a_file" / "cascade";
  for (int rep = 0; rep < 2; ++rep) {
    const CachedProfile p = cascade::cpu::cached_profile(key, in(dir), m.fn());
    CHECK(m.n_calls == rep + 1);  // measured each time: nothing could be kept
    CHECK(p.source == CachedProfile::Source::calibrated);
    CHECK(p.path.empty());
    CHECK(p.model.to_string() == m.last.to_string());
    CHECK(p.note.find("cannot keep the profile in " + dir.string()) != std::string::npos);
    CHECK(p.note.find('\n') == std::string::npos);
  }
  // A profile whose name is taken by a folder: cannot be read nor replaced.
  const fs::path dir2 = base / "cache";
  fs::create_directories(dir2 / key.file_name());
  const CachedProfile p2 = cascade::cpu::cached_profile(key, in(dir2), m.fn());
  CHECK(p2.source == CachedProfile::Source::calibrated);
  CHECK(p2.path.empty());
  CHECK(p2.note.find("cannot keep") != std::string::npos);
  CHECK(names_in(dir2) == std::vector<std::string>{key.file_name()});  // no temporary file left behind

  ProfileCacheOptions none;
  none.dir = std::nullopt;
  const CachedProfile p3 = cascade::cpu::cached_profile(key, none, m.fn());
  CHECK(p3.source == CachedProfile::Source::calibrated);
  CHECK(p3.path.empty());
  CHECK(p3.note.find("no cache folder") != std::string::npos);

  // What measure() throws is not the cache's business: it passes through.
  CHECK_THROWS_WITH(cascade::cpu::cached_profile(key, in(base / "ok"), [] () -> CostModel {
                      throw cascade::Error("calibration failed");
                    }),
                    "calibration failed");
  fs::remove_all(base);
}

TEST_CASE("profile cache: the folder is $XDG_CACHE_HOME/cascade, else $HOME/.cache/cascade") {
  {
    EnvVar xdg("XDG_CACHE_HOME", "/tmp/xdg-test-home");
    EnvVar home("HOME", "/tmp/home-test");
    CHECK(cascade::cpu::profile_cache_dir() == fs::path("/tmp/xdg-test-home/cascade"));
    CHECK(ProfileCacheOptions{}.dir == fs::path("/tmp/xdg-test-home/cascade"));
  }
  for (const char* xdg_value : {(const char*)nullptr, "", "relative/cache"}) {  // not set, empty, not absolute
    CAPTURE(xdg_value ? xdg_value : "(unset)");
    EnvVar xdg("XDG_CACHE_HOME", xdg_value);
    EnvVar home("HOME", "/tmp/home-test");
    CHECK(cascade::cpu::profile_cache_dir() == fs::path("/tmp/home-test/.cache/cascade"));
  }
  {
    EnvVar xdg("XDG_CACHE_HOME", nullptr);
    EnvVar home("HOME", nullptr);
    CHECK(!cascade::cpu::profile_cache_dir());
  }
}

TEST_CASE("profile cache: writers and readers at the same time never see a partial profile") {
  const fs::path dir = fresh_dir("cache_race");
  const ProfileKey key = a_key();
  std::atomic<bool> stop{false};
  std::atomic<int> n_read{0}, n_bad{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w)
    threads.emplace_back([&, w] {
      std::mt19937 rng{unsigned(w)};
      for (int i = 0; i < 200; ++i) cascade::cpu::write_cached_profile(dir, key, random_model(rng, 2));
    });
  threads.emplace_back([&] {
    while (!stop.load()) {
      try {
        if (cascade::cpu::read_cached_profile(dir, key)) ++n_read;
      } catch (const std::exception&) {
        ++n_bad;
      }
    }
  });
  threads[0].join();
  threads[1].join();
  stop = true;
  threads[2].join();
  CHECK(n_bad == 0);
  MESSAGE(n_read.load(), " profiles read while 400 were written");
  CHECK(names_in(dir) == std::vector<std::string>{key.file_name()});
  fs::remove_all(dir);
}

TEST_CASE("profile cache: calibrate_cached calibrates on this machine once, then reads the same profile") {
  const fs::path dir = fresh_dir("cache_real");
  const HeadShape shape{4, 2, 32};
  const CachedProfile first = cascade::cpu::calibrate_cached(1, shape, DType::f16, in(dir));
  CHECK(first.source == CachedProfile::Source::calibrated);
  CHECK(first.calibrate_s > 0);
  CHECK(first.model.n_threads == 1);
  CHECK(first.model.n_kv_heads == 2);
  CHECK(first.model.head_dim == 32);
  const CachedProfile second = cascade::cpu::calibrate_cached(1, shape, DType::f16, in(dir));
  CHECK(second.source == CachedProfile::Source::cache);
  CHECK(second.model.to_string() == first.model.to_string());
  CHECK(second.path == dir / ProfileKey::here(1, shape, DType::f16).file_name());
  fs::remove_all(dir);
}

TEST_CASE("profile cache: each K/V type is measured on its own kernels, kept apart and priced only for itself") {
  const fs::path dir = fresh_dir("cache_types");
  const HeadShape shape{4, 2, 64};
  const std::vector<DType> types = {DType::f16, DType::q8_0};
  std::vector<CachedProfile> first;
  for (DType dt : types) {
    CAPTURE(cascade::dtype_name(dt));
    const CachedProfile p = cascade::cpu::calibrate_cached(1, shape, dt, in(dir));
    // A type met for the first time is measured, never read from another type's profile.
    CHECK(p.source == CachedProfile::Source::calibrated);
    CHECK(p.model.kv_dtype == dt);
    CHECK(p.path == dir / ProfileKey::here(1, shape, dt).file_name());
    first.push_back(p);
  }
  CHECK(names_in(dir).size() == types.size());
  for (size_t i = 0; i < types.size(); ++i) {
    CAPTURE(cascade::dtype_name(types[i]));
    const CachedProfile again = cascade::cpu::calibrate_cached(1, shape, types[i], in(dir));
    CHECK(again.source == CachedProfile::Source::cache);
    CHECK(again.model.to_string() == first[i].model.to_string());
    CHECK(again.model.kv_dtype == types[i]);
  }
  // auto prices a tree with the profile of its own K/V type and refuses another type's.
  const cascade::Tree tree = cascade::Tree::two_level(HeadShape{4, 2, 64}, 300, {20, 5, 9});
  for (size_t i = 0; i < types.size(); ++i) {
    for (size_t j = 0; j < types.size(); ++j) {
      CAPTURE(cascade::dtype_name(types[i]));
      CAPTURE(cascade::dtype_name(types[j]));
      const cascade::cpu::Options opt{1, &first[i].model, types[j]};
      if (i == j) {
        CHECK(cascade::cpu::plan(tree, opt).choice().has_value());
      } else {
        const std::string said = std::string("calibrated on ") + cascade::dtype_name(types[i]) + " K/V";
        CHECK_THROWS_WITH_AS(cascade::cpu::plan(tree, opt), doctest::Contains(said.c_str()), cascade::Error);
      }
    }
  }
  // The type is part of the saved profile; one saved without it (before profiles recorded it) prices any type.
  CHECK(CostModel::parse(first[1].model.to_string()).kv_dtype == DType::q8_0);
  CostModel untyped = first[0].model;
  untyped.kv_dtype.reset();
  CHECK_FALSE(CostModel::parse(untyped.to_string()).kv_dtype.has_value());
  CHECK(cascade::cpu::plan(tree, cascade::cpu::Options{1, &untyped, DType::q8_0}).choice().has_value());
  CHECK_THROWS_AS(CostModel::parse("cascade-cost-model 1\nkv_type q4_0\n"), cascade::Error);
  // calibrate() builds K/V of the type asked for: q8_0's blocks of 32 must tile a head's row.
  CHECK_THROWS_WITH_AS(cascade::calibrate(1, HeadShape{4, 4, 48}, DType::q8_0), doctest::Contains("multiple of 32"),
                       cascade::Error);
  fs::remove_all(dir);
}

// --- cascade-generate keeps auto's profile in the cache --------------------------------------------------

namespace {

const std::string kTool = CASCADE_BINARY_DIR "/tools/cascade-generate";

// Greedy, fixed length, 2 sequences (so auto has a choice to make and needs a profile).
std::string gen_args(const std::string& extra = "") {
  return std::string("-m ") + tool_run::quote(CASCADE_MODEL_PATH) +
         " -p 'Three things every garden needs are' --temp 0 -n 10 --ignore-eos -np 2 -t 1 " + extra;
}

tool_run::Run gen(const std::string& cache_home, const std::string& extra = "") {
  return tool_run::run(kTool, gen_args(extra), "XDG_CACHE_HOME=" + tool_run::quote(cache_home));
}

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// The cost_model_source field of the tool's --json output.
std::string json_source(const std::string& out) {
  const std::string key = "\"cost_model_source\":\"";
  const size_t at = out.find(key);
  if (at == std::string::npos) return "";
  return out.substr(at + key.size(), out.find('"', at + key.size()) - at - key.size());
}

}  // namespace

TEST_CASE("profile cache: cascade-generate calibrates once per machine and key, then reads the profile") {
  REQUIRE_MESSAGE(fs::exists(CASCADE_MODEL_PATH), "the model is missing: run `bash scripts/setup.sh`");
  const fs::path home = fresh_dir("gen_cache_home");
  const fs::path dir = home / "cascade";
  const tool_run::Run first = gen(home.string());
  REQUIRE(first.rc == 0);
  INFO(first.err);
  const std::vector<std::string> files = names_in(dir);
  REQUIRE(files.size() == 1);
  const std::string file = (dir / files[0]).string();
  CHECK(first.err.find("auto's profile calibrated in ") != std::string::npos);
  CHECK(first.err.find(" and written to " + file + "\n") != std::string::npos);
  CHECK(first.err.find("auto calibration = ") != std::string::npos);
  // The file is the profile of this machine's key: 1 thread, the model's 3 KV heads of 64, f16.
  const std::string text = read(file);
  CHECK(text.rfind("cascade-profile 1\n" + ProfileKey::here(1, HeadShape{9, 3, 64}, DType::f16).text(), 0) == 0);

  const tool_run::Run second = gen(home.string(), "--json");
  REQUIRE(second.rc == 0);
  CHECK(second.err.find("auto's profile from the cache (" + file + ")") != std::string::npos);
  CHECK(second.err.find("auto calibration") == std::string::npos);
  CHECK(json_source(second.out) == "cache");
  CHECK(second.out.find("\"calibrate_ms\":0,") != std::string::npos);
  CHECK(read(file) == text);  // read, not rewritten
  const tool_run::Run third = gen(home.string());
  CHECK(third.out == first.out);  // same greedy text from the cached profile

  // A changed key (thread count, K/V type) calibrates and keeps a profile of its own.
  const tool_run::Run t2 = gen(home.string(), "-t 2");  // the later -t wins
  REQUIRE(t2.rc == 0);
  const int n_threads = tbb::info::default_concurrency();
  CHECK(names_in(dir).size() == (n_threads >= 2 ? 2u : 1u));
  const tool_run::Run f32 = gen(home.string(), "--kv-type f32");
  REQUIRE(f32.rc == 0);
  CHECK(f32.err.find("auto's profile calibrated in ") != std::string::npos);
  CHECK(names_in(dir).size() == (n_threads >= 2 ? 3u : 2u));
  CHECK(gen(home.string(), "--kv-type f32").err.find("from the cache") != std::string::npos);

  // --recalibrate measures anew and replaces the profile.
  const tool_run::Run re = gen(home.string(), "--recalibrate --json");
  REQUIRE(re.rc == 0);
  CHECK(json_source(re.out) == "calibrated");
  CHECK(re.err.find("written to " + file) != std::string::npos);
  CHECK(read(file) != text);  // a new measurement (rates to 9 digits)

  // --cost-model FILE overrides the cache: neither read nor written.
  const fs::path other_home = fresh_dir("gen_cache_other");
  const std::string profile = (other_home.string() + "_profile.txt");
  const tool_run::Run own = gen(other_home.string(), "--cost-model " + profile);
  REQUIRE(own.rc == 0);
  CHECK(own.err.find("written to " + profile) != std::string::npos);
  CHECK(!fs::exists(other_home));
  const tool_run::Run own2 = gen(other_home.string(), "--cost-model " + profile + " --json");
  CHECK(own2.err.find("auto's profile read from " + profile) != std::string::npos);
  CHECK(json_source(own2.out) == "file");
  CHECK(!fs::exists(other_home));

  // Methods that need no profile, and a single sequence, neither read nor calibrate one.
  const tool_run::Run cascade_run = gen(other_home.string(), "--attn cascade --json");
  CHECK(json_source(cascade_run.out) == "none");
  CHECK(cascade_run.err.find("profile") == std::string::npos);
  CHECK(!fs::exists(other_home));
  fs::remove(profile);
  fs::remove_all(home);
}

TEST_CASE("profile cache: cascade-generate with an unusable cache folder runs as before, with one note") {
  REQUIRE_MESSAGE(fs::exists(CASCADE_MODEL_PATH), "the model is missing: run `bash scripts/setup.sh`");
  const fs::path base = fresh_dir("gen_cache_bad");
  fs::create_directories(base);
  std::ofstream(base / "a_file") << "not a folder\n";
  const tool_run::Run reference = gen((base / "ok").string());
  REQUIRE(reference.rc == 0);
  for (int rep = 0; rep < 2; ++rep) {
    const tool_run::Run r = gen((base / "a_file").string());
    INFO(r.err);
    CHECK(r.rc == 0);
    CHECK(r.out == reference.out);
    CHECK(count(r.err, "note:") == 1);
    CHECK(count(r.err, "cascade-generate: note: cannot keep the profile in " + (base / "a_file" / "cascade").string()) == 1);
    CHECK(r.err.find("for this run only") != std::string::npos);
    CHECK(r.err.find("error") == std::string::npos);
  }
  // No XDG_CACHE_HOME: $HOME/.cache/cascade.
  const fs::path home = base / "home";
  const tool_run::Run h = tool_run::run(kTool, gen_args(), "XDG_CACHE_HOME= HOME=" + tool_run::quote(home.string()));
  CHECK(h.rc == 0);
  CHECK(names_in(home / ".cache" / "cascade").size() == 1);
  fs::remove_all(base);
}

}  // namespace test_profile_cache
