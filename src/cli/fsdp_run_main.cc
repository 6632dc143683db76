// fsdp-run: placeholder until its issue lands (see README).
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << "fsdp-run: not yet implemented (see the open issue for fsdp-run)\n";
      return 0;
    }
  }
  std::cerr << "fsdp-run: not yet implemented\n";
  return 1;
}
