// Replays fuzz inputs through a target's LLVMFuzzerTestOneInput without libFuzzer, so that
// every build (any compiler) runs the seed corpus and the crashes once found as ordinary
// tests.
//
//   connector_metadata_fuzz_replay tests/fuzz/corpus/connector_metadata
//
// Each argument is a file or a folder of files (not recursive). Exits 0 after running every
// input (a failing input aborts inside the target), 1 when an argument cannot be read or no
// input was found.
#include <dirent.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  out->assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      std::fprintf(stderr, "fuzz replay: cannot stat %s\n", argv[i]);
      return 1;
    }
    if (S_ISDIR(st.st_mode)) {
      DIR* dir = opendir(argv[i]);
      if (dir == nullptr) return 1;
      for (dirent* e = readdir(dir); e != nullptr; e = readdir(dir)) {
        const std::string name = e->d_name;
        if (name == "." || name == "..") continue;
        files.push_back(std::string(argv[i]) + "/" + name);
      }
      closedir(dir);
    } else {
      files.push_back(argv[i]);
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "fuzz replay: no inputs\n");
    return 1;
  }
  for (const std::string& path : files) {
    std::string data;
    if (!ReadFile(path, &data)) {
      std::fprintf(stderr, "fuzz replay: cannot read %s\n", path.c_str());
      return 1;
    }
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  }
  std::printf("fuzz replay: %zu inputs ran\n", files.size());
  return 0;
}
