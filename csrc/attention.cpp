#include "attention.h"
namespace tokenlake {
int64_t version() { return 1; }
}
