// kvd_wire_dump: prints kvd/wire.h's constants, and its functions applied to the inputs given on the
// command line, as one JSON document, for tests/client/python/wire_test.py to compare with the Python
// package's copy (client/python/kvd/_wire.py).
//
//   kvd_wire_dump [--device N]... [--socket PATH]... [--name FILE]...
//
// {"constants": {"kDefaultSocketDir": ..., ...},
//  "default_socket": [[N, path]...], "socket_from_environment": [[N, path]...],
//  "handles_path_for": [[socket, path]...], "is_socket_name": [[name, bool]...],
//  "socket_dir_from_environment": dir}
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "kvd/wire.h"

namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

// Appends [input, output] to `list`.
template <typename In, typename Out>
void AddPair(ListValue* list, const In& in, const Out& out) {
  ListValue* pair = list->add_values()->mutable_list_value();
  auto set = [](Value* v, const auto& x) {
    using T = std::decay_t<decltype(x)>;
    if constexpr (std::is_same_v<T, bool>) {
      v->set_bool_value(x);
    } else if constexpr (std::is_same_v<T, int>) {
      v->set_number_value(x);
    } else {
      v->set_string_value(x);
    }
  };
  set(pair->add_values(), in);
  set(pair->add_values(), out);
}

ListValue* List(Struct* doc, const char* key) { return (*doc->mutable_fields())[key].mutable_list_value(); }

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> devices;
  std::vector<std::string> sockets, names;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    int device = 0;
    if (flag == "--device" && absl::SimpleAtoi(value, &device)) {
      devices.push_back(device);
    } else if (flag == "--socket") {
      sockets.push_back(value);
    } else if (flag == "--name") {
      names.push_back(value);
    } else {
      std::fprintf(stderr, "kvd_wire_dump: bad argument %s %s\n", flag.c_str(), value.c_str());
      return 2;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "kvd_wire_dump: usage: kvd_wire_dump [--device N]... [--socket PATH]... [--name FILE]...\n");
    return 2;
  }

  namespace wire = kvd::wire;
  Struct doc;
  auto& constants = *(*doc.mutable_fields())["constants"].mutable_struct_value()->mutable_fields();
  constants["kDefaultSocketDir"].set_string_value(wire::kDefaultSocketDir);
  constants["kSocketPrefix"].set_string_value(wire::kSocketPrefix);
  constants["kSocketSuffix"].set_string_value(wire::kSocketSuffix);
  constants["kHandlesSuffix"].set_string_value(wire::kHandlesSuffix);
  constants["kSessionMetadataKey"].set_string_value(wire::kSessionMetadataKey);
  constants["kSocketEnv"].set_string_value(wire::kSocketEnv);
  constants["kSocketDirEnv"].set_string_value(wire::kSocketDirEnv);
  constants["kLayoutEnv"].set_string_value(wire::kLayoutEnv);
  constants["kDraIpcDirEnv"].set_string_value(wire::kDraIpcDirEnv);
  for (int d : devices) {
    AddPair(List(&doc, "default_socket"), d, wire::DefaultSocket(d));
    AddPair(List(&doc, "socket_from_environment"), d, wire::SocketFromEnvironment(d));
  }
  for (const std::string& s : sockets) AddPair(List(&doc, "handles_path_for"), s, wire::HandlesPathFor(s));
  for (const std::string& n : names) AddPair(List(&doc, "is_socket_name"), n, wire::IsSocketName(n));
  (*doc.mutable_fields())["socket_dir_from_environment"].set_string_value(wire::SocketDirFromEnvironment());

  std::string out;
  if (!google::protobuf::util::MessageToJsonString(doc, &out).ok()) {
    std::fprintf(stderr, "kvd_wire_dump: cannot render JSON\n");
    return 1;
  }
  std::printf("%s\n", out.c_str());
  return 0;
}
