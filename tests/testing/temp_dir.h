// A directory of a test's own under /tmp, removed with everything in it when the owner goes.
//
//   TempDir dir;                       // /tmp/kvstream-test-XXXXXX
//   ASSERT_TRUE(dir.ok());
//   WriteSomething(dir.path() + "/file");
#ifndef KVSTREAM_TESTS_TESTING_TEMP_DIR_H_
#define KVSTREAM_TESTS_TESTING_TEMP_DIR_H_

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace kvstream {

class TempDir {
 public:
  TempDir() {
    std::string name = "/tmp/kvstream-test-XXXXXX";
    if (mkdtemp(name.data()) != nullptr) path_ = name;
  }
  ~TempDir() {
    std::error_code ignored;
    if (ok()) std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // Whether the directory could be made; path() is empty otherwise.
  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace kvstream

#endif  // KVSTREAM_TESTS_TESTING_TEMP_DIR_H_
