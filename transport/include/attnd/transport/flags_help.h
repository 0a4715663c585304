// --help for the command-line binaries (attnd, attn): the program's usage message and the flags defined in its
// main file, with their defaults, on stdout, and exit status 0. Abseil's own --help only lists flags of files
// named after the program and exits 1; --helpfull keeps Abseil's meaning (every flag linked in).
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/string_view.h"

namespace attnd {

// Call before absl::ParseCommandLine with `main_file` = __FILE__ of the file that defines the program's flags.
inline void HandleHelpFlag(int argc, char** argv, absl::string_view main_file) {
  bool wanted = false;
  for (int i = 1; i < argc && std::strcmp(argv[i], "--") != 0; ++i) {
    const absl::string_view a = argv[i];
    wanted |= a == "--help" || a == "-help" || a == "--helpshort" || a == "-helpshort" || a == "-h";
  }
  if (!wanted) return;
  // Abseil reports a flag's file with its leading slashes stripped (absl's default normalize_filename), so an
  // absolute __FILE__ is compared the same way.
  const size_t start = main_file.find_first_not_of("/\\");
  main_file.remove_prefix(start == absl::string_view::npos ? main_file.size() : start);
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (flag->Filename() == main_file) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(), [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::cout << absl::ProgramUsageMessage() << "\n\nFlags (--helpfull: every flag, the libraries' too):\n";
  for (const absl::CommandLineFlag* f : flags) {
    std::string value = f->DefaultValue();
    if (f->IsOfType<std::string>()) value = "\"" + value + "\"";
    std::cout << "  --" << f->Name() << " (" << f->Help() << "); default: " << value << "\n";
  }
  std::cout.flush();
  std::exit(0);
}

}  // namespace attnd
