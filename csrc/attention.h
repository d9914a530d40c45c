#pragma once
#include <cstdint>
namespace tokenlake {
int64_t version();
}
