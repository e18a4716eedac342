# cmake -DINPUT=file -DOUTPUT=file.cc -DSYMBOL=kName -P embed_binary.cmake
# Writes a C++ source defining `extern const unsigned char kvd::<SYMBOL>[]` (64-byte aligned) with
# INPUT's bytes and `extern const size_t kvd::<SYMBOL>Size`.
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" hex_length)
math(EXPR size "${hex_length} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
string(REPEAT "0x..," 16 row)
string(REGEX REPLACE "(${row})" "\\1\n" bytes "${bytes}")
get_filename_component(name "${INPUT}" NAME)
file(WRITE "${OUTPUT}.tmp"
  "// Generated from ${name} by embed_binary.cmake. Do not edit.\n"
  "#include <cstddef>\n\n"
  "namespace kvd {\n\n"
  "alignas(64) extern const unsigned char ${SYMBOL}[] = {\n${bytes}\n};\n"
  "extern const size_t ${SYMBOL}Size = ${size};\n\n"
  "}  // namespace kvd\n")
file(RENAME "${OUTPUT}.tmp" "${OUTPUT}")
