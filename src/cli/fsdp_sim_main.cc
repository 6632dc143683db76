// fsdp-sim: placeholder until its issue lands (see README).
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << "fsdp-sim: not yet implemented (see the open issue for fsdp-sim)\n";
      return 0;
    }
  }
  std::cerr << "fsdp-sim: not yet implemented\n";
  return 1;
}
